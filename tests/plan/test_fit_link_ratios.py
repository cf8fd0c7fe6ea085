"""benchmarks/fit_link_ratios.py on a kept sweep made up here: steps that ran as a paired ratio of 0.64 and a one-way
ratio of 1.5 price them give back those two, written into a copy of the cluster's file that plans with them; a sweep
whose steps counted the pipeline's last step is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embark_torchrec.plan.model.hardware_file import hardware_sources, load_hardware, save_hardware
from tests.support.benchmarks import load_benchmark, made_up_sweep
from tests.support.processes import ROOT

fit = load_benchmark("fit_link_ratios")
CALIBRATED = ROOT / "benchmarks" / "cluster_e2e_multihot_zipf_50mbit.hardware.json"
TRUE_RATIOS = {"inter_node_paired_ratio": 0.64, "inter_node_one_way_ratio": 1.5}
PHASE_OVERLAP = 0.0  # the phases priced in turn, as on the emulated cluster
TRUE_SOLO = 1.4  # a rank alone on its node's link, over its share


def _kept_sweep(tmp_path: Path, seeds: tuple[int, ...], last_step_measured: bool = False) -> Path:
    """A sweep's folder whose runs measured what the cost model prices at TRUE_RATIOS (plus batch making)."""
    truth = load_hardware(CALIBRATED).with_overrides(**TRUE_RATIOS, inter_node_phase_overlap=PHASE_OVERLAP)
    return made_up_sweep(tmp_path, seeds, truth, CALIBRATED, last_step_measured=last_step_measured)


def test_the_fit_recovers_the_ratios_the_steps_ran_at_and_writes_them(tmp_path: Path) -> None:
    kept = _kept_sweep(tmp_path, (3, 11))
    calibrated = load_hardware(CALIBRATED)
    assert all(getattr(calibrated, field) != pytest.approx(value, abs=0.05) for field, value in TRUE_RATIOS.items())
    out = tmp_path / "fitted.hardware.json"
    argv = ["--sweeps", str(kept), "--hardware", str(CALIBRATED), "--out", str(out), "--phase-overlap", "0"]
    assert fit.main(argv) == 0
    fitted = load_hardware(out)
    assert fitted == calibrated.with_overrides(**TRUE_RATIOS, inter_node_phase_overlap=PHASE_OVERLAP)
    assert all((hardware_sources(str(out)) or {})[field] == "measured" for field in TRUE_RATIOS)
    residuals = json.loads(out.read_text())["measurements"]["inter_node_one_way_ratio"]
    assert residuals["samples"] == 6  # 2 models x embark, torchrec, trw
    assert residuals["min"] == pytest.approx(1.0) and residuals["max"] == pytest.approx(1.0)


def test_a_sweep_that_counted_the_pipeline_s_last_step_is_refused(tmp_path: Path) -> None:
    kept = _kept_sweep(tmp_path, (3,), last_step_measured=True)
    with pytest.raises(SystemExit, match="last step"):
        fit.ran_plans(kept)


def test_fit_solo_recovers_the_solo_ratio_training_s_steps_ran_at(tmp_path: Path) -> None:
    """--fit-solo: steps that ran as a rank alone on its node's link at 1.4x its share (not the 1.0 the file says)
    give back 1.4 with the other ratios, written as measured; without the flag the file's solo ratio stays."""
    truth = load_hardware(CALIBRATED).with_overrides(
        **TRUE_RATIOS, inter_node_phase_overlap=PHASE_OVERLAP, inter_node_solo_ratio=TRUE_SOLO
    )
    kept = made_up_sweep(tmp_path, (3, 11), truth, CALIBRATED)
    out = tmp_path / "fitted.hardware.json"
    argv = ["--sweeps", str(kept), "--hardware", str(CALIBRATED), "--out", str(out), "--phase-overlap", "0"]
    held = ["--one-way", str(TRUE_RATIOS["inter_node_one_way_ratio"])]
    assert fit.main([*argv, *held, "--fit-solo"]) == 0
    assert load_hardware(out) == truth
    assert (hardware_sources(str(out)) or {})["inter_node_solo_ratio"] == "measured"
    assert fit.main([*argv, *held]) == 0
    assert load_hardware(out).inter_node_solo_ratio == load_hardware(CALIBRATED).inter_node_solo_ratio != TRUE_SOLO


def test_the_scaling_curve_plans_with_the_fitted_figures_where_given(tmp_path: Path) -> None:
    """benchmarks/scaling.py --link-ratios: a size's calibrated file gets the fitted file's paired, one-way and solo
    ratios and phase overlap (and their sources), every other figure its own; without it, the calibrated file as is."""
    scaling = load_benchmark("scaling")
    fitted = tmp_path / "fitted.hardware.json"
    document = json.loads(CALIBRATED.read_text())
    linked = TRUE_RATIOS | {"inter_node_phase_overlap": PHASE_OVERLAP, "inter_node_solo_ratio": TRUE_SOLO}
    document["hardware"] |= linked | {"collective_us": 1.0}
    fitted.write_text(json.dumps(document))
    merged = tmp_path / "merged.hardware.json"
    save_hardware(merged, scaling.with_link_ratios(CALIBRATED, fitted))
    calibrated = load_hardware(CALIBRATED)
    assert load_hardware(merged) == calibrated.with_overrides(**linked)
    assert scaling.with_link_ratios(CALIBRATED, None) == json.loads(CALIBRATED.read_text())


def test_one_size_s_scaling_points_fit_the_paired_ratio_with_the_one_way_ratio_held(tmp_path: Path) -> None:
    """--points: the runs benchmarks/scaling.py kept at one size (its rounds.json: the model's file and each run's
    size) give back the paired ratio their steps ran at, with --one-way holding the one-way ratio where given."""
    sweep_folder = load_benchmark("sweep").model_folder(_kept_sweep(tmp_path, (3,)), 3)
    point = tmp_path / "scaling" / "generated_2x2"
    point.mkdir(parents=True)
    (point / "model.json").write_text((sweep_folder / "spec.json").read_text())
    kept = json.loads((sweep_folder / "rounds.json").read_text())["runs"]
    shape = {"world_size": 4, "local_world_size": 2, "batch_size": 512}
    runs = {run: [r | shape for r in kept[run]] for run in ("embark", "torchrec", "trw")}
    (point / "rounds.json").write_text(json.dumps({"model": str(point / "model.json"), "nodes": 2, "runs": runs}))
    for name in ("hardware.json", "embark.plan.json", "torchrec.plan.json", "trw.plan.json"):
        (point / name).write_text((sweep_folder / name).read_text())
    out = tmp_path / "links.hardware.json"
    argv = ["--points", str(point), "--hardware", str(CALIBRATED), "--out", str(out), "--phase-overlap", "0"]
    assert fit.main([*argv, "--one-way", str(TRUE_RATIOS["inter_node_one_way_ratio"])]) == 0
    fitted = load_hardware(out)
    assert fitted == load_hardware(CALIBRATED).with_overrides(**TRUE_RATIOS, inter_node_phase_overlap=PHASE_OVERLAP)
    with pytest.raises(SystemExit):
        fit.parse_args([*argv, "--one-way", "0.5"])


def test_the_scaling_curve_takes_link_ratios_per_size() -> None:
    """--link-ratios NODES=FILE,...: each size priced with its own file, a size without one as calibrated; a plain
    FILE serves every size; a malformed entry stops before any run, naming it."""
    scaling = load_benchmark("scaling")
    args = scaling.parse_args(["--link-ratios", f"2={CALIBRATED},4={CALIBRATED}", "--nodes", "1,2,4"])
    assert {n: scaling.ratios_for(args, n) for n in (1, 2, 4)} == {1: None, 2: CALIBRATED, 4: CALIBRATED}
    every = scaling.parse_args(["--link-ratios", str(CALIBRATED)])
    assert scaling.ratios_for(every, 8) == CALIBRATED
    assert scaling.ratios_for(scaling.parse_args([]), 2) is None
    with pytest.raises(SystemExit):
        scaling.parse_args(["--link-ratios", f"two={CALIBRATED}"])


def test_dilated_links_slow_as_the_ranks_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dilate-links: a size whose ranks share the box's cores gets its link slowed by the same factor as their
    compute (2 cores: 4 ranks at half --link-mbit, 8 at a quarter; ranks with a core each at --link-mbit); without
    it every size keeps --link-mbit. One node runs --single-node-steps, a cluster --steps."""
    scaling = load_benchmark("scaling")
    monkeypatch.setattr(scaling, "CORES", 2)
    dilated = scaling.parse_args(["--link-mbit", "100", "--dilate-links", "--gpus-per-node", "2"])
    assert [scaling.link_mbit(dilated, n) for n in (1, 2, 4)] == [100.0, 50.0, 25.0]
    fixed = scaling.parse_args(["--link-mbit", "50", "--gpus-per-node", "2"])
    assert [scaling.link_mbit(fixed, n) for n in (1, 2, 4)] == [50.0, 50.0, 50.0]
    steps = scaling.parse_args(["--steps", "16", "--single-node-steps", "100"])
    assert [scaling.at_size(steps, n).steps for n in (1, 2, 4)] == [100, 16, 16]
    assert steps.steps == 16


def test_the_curve_s_targets_show_the_lead_and_link_share_they_judge() -> None:
    """scaling.py's targets on the kept curve's 2- and 4-node points: the lead over TWRW at 2 and 4 nodes and TWRW's
    link share per size are printed beside the verdict they give (a lead that shrinks is not met)."""
    scaling = load_benchmark("scaling")
    kept = ROOT / "benchmarks" / "scaling_dilated_solo" / "multihot_zipf_{}x2" / "rounds.json"
    runs = {n: json.loads(Path(str(kept).format(n)).read_text())["runs"] for n in (2, 4)}
    estimated = {n: {plan: rounds[0]["estimated_step_ms"] for plan, rounds in runs[n].items()} for n in (2, 4)}
    shares = {2: {"trw": 0.56}, 4: {"trw": 0.59}}
    points = [scaling.Point(runs[n], estimated[n], "multihot_zipf", n, shares[n]) for n in (2, 4)]
    lines = scaling.targets(points)
    assert "- multihot_zipf: lead over trw at 4 nodes >= at 2 (1.70x -> 1.98x): met" in lines
    assert "- multihot_zipf: trw's link share grows with nodes (56% -> 59%): met" in lines
    swapped = [scaling.Point(runs[6 - n], estimated[6 - n], "m", n, {}) for n in (2, 4)]  # 4 nodes' rounds at 2
    shrunk = scaling.targets(swapped)
    assert "- m: lead over trw at 4 nodes >= at 2 (1.98x -> 1.70x): **not met**" in shrunk
