"""python -m embark_torchrec.calibrate and hardware files.

The calibration runs as users run it, under torchrun: 4 gloo ranks as 2 simulated nodes x 2, in --quick mode;
the file it writes loads and plans. Hand-written files are read as strictly as spec and plan files: every error
names the file and the field. The planner CLI, EmbarkPlanner and the DLRM example take a file wherever a preset
name goes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embark_torchrec.plan import cli
from embark_torchrec.plan.model.hardware_file import (
    FORMAT,
    HardwareError,
    hardware_to_dict,
    load_hardware,
    resolve_hardware,
    save_hardware,
)
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.planner.planner import EmbarkPlanner
from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import PRESETS, Hardware, Topology
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from tests.support.processes import ROOT, checkout_env

MEASURED = {"collective_us", "intra_node_bw_gbps", "inter_node_bw_gbps", "hbm_bw_gbps", "lookup_ns_per_id"}
MEASURED |= {"unique_ns_per_id", "dp_ns_per_element", "update_ns_per_row", "inter_node_paired_ratio"}
MEASURED |= {"inter_node_solo_ratio", "inter_node_one_way_ratio", "allreduce_bus_gbps"}
SPEC = ModelSpec(
    "small",
    256,
    (TableSpec("a", 50_000, 16, 4.0), TableSpec("b", 2_000, 16, 1.0), TableSpec("c", 20, 8, 2.0)),
)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The hardware file of one quick calibration on 4 gloo ranks as 2 nodes x 2, and what rank 0 printed."""
    out = tmp_path_factory.mktemp("calibrate") / "hardware.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
    cmd += ["-m", "embark_torchrec.calibrate", "--quick", "--local-world-size", "2", "--out", str(out)]
    env = checkout_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_quick_calibration_measures_every_figure_it_can_with_its_spread(calibrated: tuple[Path, str]) -> None:
    """Every figure the cost model uses is in the file: those 4 ranks on one host can measure (latency, both
    bandwidths across the simulated nodes, per-ID and per-byte lookup cost, a DP table's update per element, UB
    host work) are measured,
    positive and finite, each with its median, quartiles, range and sample count; host_cores is read off the
    machine; the rest are the base preset's, marked so; the run says when, where and on what it ran."""
    path, printed = calibrated
    document = json.loads(path.read_text())
    hardware = load_hardware(path)
    base = PRESETS[document["base"]]
    assert document["base"] == "cpu-gloo" and set(document["sources"]) == {f.name for f in fields(Hardware)}
    assert {f for f, source in document["sources"].items() if source == "measured"} == MEASURED
    for field in MEASURED:
        value = getattr(hardware, field)
        # a per-ID lookup cost is a regression slope: on a busy 2-core box its noise can reach zero (kept at 0)
        non_negative = field in ("lookup_ns_per_id", "update_ns_per_row")
        assert math.isfinite(value) and (value >= 0 if non_negative else value > 0), (field, value)
        spread = document["measurements"][field]
        assert spread["samples"] >= 2 and spread["min"] <= spread["p25"] <= spread["median"] <= spread["p75"]
        assert spread["p75"] <= spread["max"] and spread["unit"] and spread["what"]
    # the paired ratio is taken sample by sample against the all-ranks rate, not from the two medians
    paired = document["measurements"]["inter_node_paired_bw_gbps"]
    assert "cross-node group of 2 ranks" in paired["what"] and "taking turns" in paired["what"]
    ratio = document["measurements"]["inter_node_paired_ratio"]
    assert hardware.inter_node_paired_ratio == ratio["median"] and ratio["samples"] <= paired["samples"]
    # one way is measured against both ways sample by sample too, and kept within what the cost model allows
    one_way = document["measurements"]["inter_node_one_way_ratio"]
    assert "one way" in one_way["what"] and 1.0 <= hardware.inter_node_one_way_ratio <= 2.0
    assert hardware.unique_ns_per_id >= document["measurements"]["dedup_ns_per_id"]["median"] > 0
    # a group's collective in a real training step costs at least a bare all-to-all
    assert hardware.collective_us >= document["measurements"]["alltoall_latency_us"]["median"] > 0
    assert "trained table-wise in DMP" in document["measurements"]["collective_us"]["what"]
    assert hardware.host_cores == len(os.sched_getaffinity(0)) and document["sources"]["host_cores"] == "machine"
    for field, source in document["sources"].items():
        if source == "preset" and field != "name":
            assert getattr(hardware, field) == getattr(base, field), field
    run = document["run"]
    assert (run["backend"], run["device"], run["world_size"], run["local_world_size"]) == ("gloo", "cpu", 4, 2)
    assert run["quick"] is True and run["date"] and run["host"] and run["optimizer"] == "exact_rowwise_adagrad"
    assert f"hardware file written to {path}" in printed and "collective_us" in printed


def test_calibrated_file_plans(calibrated: tuple[Path, str]) -> None:
    """The file plans as a preset does: plan_model on a Topology with its Hardware, and EmbarkPlanner given its
    path (the figures reach the planned topology unchanged)."""
    path, _ = calibrated
    hardware = load_hardware(path)
    planned = plan_model(SPEC, Topology(4, 2, hardware))
    assert math.isfinite(planned.cost.step_ms) and planned.cost.step_ms > 0
    planner = EmbarkPlanner(world_size=4, local_world_size=2, batch_size=64, hardware=str(path), compute_device="cpu")
    plan = planner.plan(_Model(), [EmbarkEmbeddingBagCollectionSharder()])
    assert set(plan.plan["sparse"]) == {"a", "b", "c"} and planner.plans["sparse"].topology.hardware == hardware


# ---------------------------------------------------------------- hand-written files


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=[t.name])
            for t in SPEC.tables
        ]
        self.sparse = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def _document(**hardware: Any) -> dict[str, Any]:
    figures = {**hardware_to_dict(PRESETS["cpu-gloo"]), "name": "my-box", **hardware}
    return {"format": FORMAT, "version": 1, "hardware": figures}


def _write(tmp_path: Path, document: dict[str, Any] | str) -> Path:
    path = tmp_path / "box.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def _drop(field: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["hardware"].pop(field)


UNORDERED = {"median": 1, "p25": 2, "p75": 3, "min": 0, "max": 4, "samples": 5, "unit": "us"}
BAD_FILES: dict[str, tuple[Callable[[dict[str, Any]], Any], list[str]]] = {
    "typo'd field": (lambda d: d["hardware"].update(colective_us=5.0), ["hardware.colective_us", "'collective_us'"]),
    "typo'd section": (lambda d: d.update(measurments={}), ["measurments", "did you mean 'measurements'"]),
    "missing field": (_drop("lookup_ns_per_id"), ["hardware.lookup_ns_per_id", "required"]),
    "bandwidth 0": (
        lambda d: d["hardware"].update(inter_node_bw_gbps=0),
        ["hardware.inter_node_bw_gbps", "in [0.001, "],
    ),
    "negative latency": (lambda d: d["hardware"].update(collective_us=-1.0), ["hardware.collective_us", "in [0, "]),
    "cores as a float": (lambda d: d["hardware"].update(host_cores=2.0), ["hardware.host_cores", "integer"]),
    "reserve above memory": (lambda d: d["hardware"].update(hbm_reserve_gb=20.0), ["hardware.hbm_reserve_gb"]),
    "another format": (lambda d: d.update(format="embark-plan"), ["field 'format'", "embark-hardware"]),
    "unknown source": (lambda d: d.update(sources={"hbm_gb": "guessed"}), ["sources.hbm_gb", "'measured'"]),
    "spread out of order": (lambda d: d.update(measurements={"x": UNORDERED}), ["measurements.x", "min <= p25"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_hardware_files_are_refused_naming_file_and_field(case: str, tmp_path: Path) -> None:
    """Typo'd keys (with a did-you-mean), missing fields, values of the wrong type or out of range, another
    file's format and inconsistent spreads are HardwareErrors naming the file and the field, from the loader,
    EmbarkPlanner and the CLI (one line, exit 2)."""
    change, needles = BAD_FILES[case]
    document = _document()
    change(document)
    path = _write(tmp_path, document)
    for error in (lambda: load_hardware(path), lambda: EmbarkPlanner(world_size=2, hardware=str(path))):
        with pytest.raises(HardwareError) as raised:
            error()
        assert str(raised.value).startswith(f"{path}: ") and all(n in str(raised.value) for n in needles), raised.value
    assert cli.main(["dcnv2", "--world-size", "2", "--local-world-size", "2", "--hardware", str(path)]) == 2


def test_nan_and_invalid_json_are_refused_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NaN (which Python's json reads) is no finite figure; an unparsable file is named with the line."""
    nan = json.dumps(_document(collective_us=750.0)).replace('"collective_us": 750.0', '"collective_us": NaN')
    with pytest.raises(HardwareError, match=r"box\.json: field 'hardware\.collective_us': expected a finite number"):
        load_hardware(_write(tmp_path, nan))
    assert (
        cli.main(["dcnv2", "--world-size", "2", "--local-world-size", "2", "--hardware", str(tmp_path / "box.json")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hardware" in err and "hardware.collective_us" in err, err
    with pytest.raises(HardwareError, match=r"box\.json: invalid JSON"):
        load_hardware(_write(tmp_path, '{"format": "embark-hardware",'))


def test_presets_files_and_unknown_names_resolve_apart(tmp_path: Path) -> None:
    """A preset name is the preset; a path ending in .json (or an existing file) is a file, and a missing one
    is a HardwareError naming it; any other name is refused listing the presets."""
    assert resolve_hardware("dgx-h100") is PRESETS["dgx-h100"]
    path = _write(tmp_path, _document(collective_us=12.0))
    assert resolve_hardware(str(path)) == Hardware(**_document(collective_us=12.0)["hardware"])
    with pytest.raises(HardwareError, match="nope.json: cannot read"):
        resolve_hardware(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=r"unknown hardware preset 'tpu'.*'dgx-h100'"):
        resolve_hardware("tpu")


def test_cli_and_planner_plan_with_a_hardware_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's --hardware and EmbarkPlanner's hardware= take a file: the report names its hardware, and its
    figures (here a collective 100x dearer than cpu-gloo's) change the estimate as a preset's would."""
    path = _write(tmp_path, _document(collective_us=75_000.0))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC.to_dict()))
    sizes = ["--world-size", "4", "--local-world-size", "2"]
    assert cli.main([str(spec), *sizes, "--hardware", str(path)]) == 0
    assert "hardware my-box" in capsys.readouterr().out
    steps = {}
    for name, hardware in (("file", str(path)), ("preset", "cpu-gloo")):
        assert cli.main([str(spec), *sizes, "--hardware", hardware, "--json"]) == 0
        steps[name] = json.loads(capsys.readouterr().out)["plans"]["embark"]["step_ms"]
    assert steps["file"] > steps["preset"] + 50.0
    planner = EmbarkPlanner(world_size=4, local_world_size=2, hardware=str(path), compute_device="cpu")
    assert planner.hardware == load_hardware(path) and planner.hardware.collective_us == 75_000.0


def test_save_hardware_writes_only_what_loads(tmp_path: Path) -> None:
    """save_hardware checks the document first, so a file it writes always loads back equal."""
    document = _document(collective_us=12.5)
    save_hardware(tmp_path / "ok.json", document)
    assert load_hardware(tmp_path / "ok.json").collective_us == 12.5
    document["hardware"]["collective_us"] = math.inf
    with pytest.raises(HardwareError, match="hardware.collective_us"):
        save_hardware(tmp_path / "bad.json", document)
    assert not (tmp_path / "bad.json").exists()


def test_example_calibrate_flag_and_its_conflict_with_plan_in() -> None:
    """examples/dlrm/train.py: --calibrate (default full, or quick) measures to plan with, which --plan-in
    (no planning) contradicts."""
    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    import train

    assert train.parse_args(["--calibrate"]).calibrate == "full"
    assert train.parse_args(["--calibrate", "quick", "--hardware", "box.json"]).hardware == "box.json"
    assert train.parse_args(["--calibrate", "dense", "--hardware", "box.json"]).calibrate == "dense"
    with pytest.raises(SystemExit):
        train.parse_args(["--calibrate", "--plan-in", "plan.json"])
    for without_file in ([], ["--hardware", "cpu-gloo"]):  # dense measures into a calibrated file: none, a preset
        with pytest.raises(SystemExit):
            train.parse_args(["--calibrate", "dense", *without_file])


def test_example_dense_step_is_timed_per_ksample_and_its_parameters_counted(tmp_path: Path) -> None:
    """--calibrate times the example's dense part (a copy: the model's own weights do not move) on every rank,
    per 1000 samples, and counts its parameters' fp32 gradient bytes (dense_params_mb, the model's figure)."""
    import torch.distributed as dist

    from embark_torchrec import calibrate

    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    import train

    model = train.build_model(train.default_spec(), 13, torch.device("cpu"))
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.device.type != "meta"}
    dense = train.dense_step(model, 64, 13, torch.device("cpu"))
    expected = sum(p.numel() for name, p in model.named_parameters() if "sparse_arch" not in name)
    assert dense.samples == 64 and dense.params == expected
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        job = calibrate._job()
        settings = calibrate.quick(calibrate.CPU_SETTINGS)
        measured = calibrate.measure_dense(job, settings, dense)
        hardware = calibrate._hardware(PRESETS["cpu-gloo"], measured, job, dense)
    finally:
        dist.destroy_process_group()
    spread = measured["dense_ms_per_ksample"]
    assert spread["samples"] == settings.repeats and 0 < spread["min"] <= spread["median"]
    assert hardware.dense_ms_per_ksample == spread["median"] and hardware.dense_params_mb == expected * 4 / 1e6
    for name, p in model.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]), name


def test_dense_recalibration_measures_only_the_model_s_dense_part(calibrated: tuple[Path, str], tmp_path: Path) -> None:
    """--calibrate dense: a calibrated cluster's file for another model keeps every cluster figure, measurement and
    source, and replaces the dense figures with this model's (measured, and counted); on a job of another shape than
    the file's calibration it is refused, naming the file, before any collective."""
    import torch.distributed as dist

    from embark_torchrec import calibrate

    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    import train

    path, _ = calibrated
    document = json.loads(path.read_text())
    model = train.build_model(train.default_spec(), 13, torch.device("cpu"))
    dense = train.dense_step(model, 64, 13, torch.device("cpu"))
    one_rank = {**document, "run": {**document["run"], "world_size": 1, "local_world_size": 1}}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        settings = calibrate.quick(calibrate.CPU_SETTINGS)
        with pytest.raises(HardwareError, match=f"{path}: calibrated on 4 ranks, 2 per node; this job has 1"):
            calibrate.recalibrate_dense(document, settings, dense, str(path))
        out = calibrate.recalibrate_dense(one_rank, settings, dense, str(path))
    finally:
        dist.destroy_process_group()
    dense_figures = {"dense_ms_per_ksample", "dense_params_mb"}
    for field, value in document["hardware"].items():
        if field not in dense_figures:
            assert out["hardware"][field] == value, field
    assert out["hardware"]["dense_ms_per_ksample"] == out["measurements"]["dense_ms_per_ksample"]["median"] > 0
    assert out["hardware"]["dense_params_mb"] == dense.params * 4 / 1e6
    assert out["sources"] == {**document["sources"], "dense_ms_per_ksample": "measured", "dense_params_mb": "model"}
    assert {k: v for k, v in out["measurements"].items() if k != "dense_ms_per_ksample"} == document["measurements"]
    save_hardware(tmp_path / "model.hardware.json", out)  # what it makes loads
    assert load_hardware(tmp_path / "model.hardware.json").dense_params_mb == dense.params * 4 / 1e6


def test_lookups_drowned_by_a_busy_host_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU a lookup costs hundreds of ns per ID; rounds in which the larger pooling was no slower per ID
    (other work on the host swamped the difference) must stop calibrate with a CalibrationError rather than
    write a per-ID cost near zero, which would price every CPU plan's lookups far too low."""
    import torch.distributed as dist

    from embark_torchrec import calibrate

    settings = calibrate.quick(calibrate.CPU_SETTINGS)
    ids_few, ids_many = settings.lookup_batch * calibrate.FEW, settings.lookup_batch * calibrate.MANY
    distinct = (ids_few, ids_many, calibrate.REPEAT_ROWS)  # IDs that never repeat but over the small table
    repeating = ids_many * 300e-9 - (ids_many - calibrate.REPEAT_ROWS) * 100e-9  # 100 ns of it per distinct row
    steady = (ids_few * 300e-9, ids_many * 300e-9, ids_many * 320e-9, repeating)  # 300 ns per ID, slower when wider
    busy = (ids_many * 300e-9, ids_many * 300e-9, ids_many * 320e-9, repeating)  # a stall made the few-ID one as slow
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        job = calibrate._job()
        monkeypatch.setattr(calibrate, "_lookup_rounds", lambda *_: ([steady] * 6 + [busy] * 2, distinct))
        measured = calibrate.measure_lookups(job, settings, "exact_sgd")
        assert measured["lookup_ns_per_id"]["median"] == pytest.approx(
            200 - calibrate.NARROW * 20 / (calibrate.WIDE - calibrate.NARROW), rel=1e-6
        )
        assert measured["update_ns_per_row"]["median"] == pytest.approx(100, rel=1e-6)
        assert measured["tbe_step_ms"]["median"] == pytest.approx(ids_many * 320e-6, rel=1e-6)  # the widest step
        monkeypatch.setattr(calibrate, "_lookup_rounds", lambda *_: ([steady] * 5 + [busy] * 3, distinct))
        with pytest.raises(calibrate.CalibrationError, match="too busy to measure lookup_ns_per_id"):
            calibrate.measure_lookups(job, settings, "exact_sgd")
    finally:
        dist.destroy_process_group()


def test_tbe_step_estimate_prices_the_measured_step_as_the_cost_model_does() -> None:
    """What benchmarks/gpu_check.py sets against tbe_step_ms: the cost model's lookups of that very step (lookup_batch
    bags of MANY IDs into one table of width WIDE), bytes at hbm_bw_gbps plus lookup_ns_per_id per ID."""
    from embark_torchrec import calibrate
    from embark_torchrec.plan.model.constants import BACKWARD_COMPUTE_MULTIPLIER, WEIGHT_BYTES

    settings = calibrate.GPU_SETTINGS
    ids = settings.lookup_batch * calibrate.MANY
    h100 = PRESETS["dgx-h100"]
    byte_ms = ids * calibrate.WIDE * WEIGHT_BYTES * (1 + BACKWARD_COMPUTE_MULTIPLIER) / h100.hbm_bw_gbps / 1e6
    assert calibrate.tbe_step_estimate_ms(h100, settings) == pytest.approx(byte_ms, rel=1e-9)
    per_id = h100.with_overrides(lookup_ns_per_id=2.0)
    assert calibrate.tbe_step_estimate_ms(per_id, settings) == pytest.approx(byte_ms + ids * 2.0 / 1e6, rel=1e-9)
    assert calibrate.tbe_step_estimate_ms(PRESETS["h200"], settings) < byte_ms  # more bandwidth, a shorter step
