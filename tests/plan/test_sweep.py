"""benchmarks/sweep.py's arithmetic, on rounds made up here: the speedups are medians of per-round ratios, the error on
plan differences is the worst |predicted - measured| speedup of embark over torchrec, and the hardware file it writes
plans with that error (the runs themselves need the emulated cluster: `make test` does not start one)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from embark_torchrec.plan.model.hardware_file import hardware_sources, load_hardware
from tests.support.benchmarks import load_benchmark
from tests.support.processes import ROOT

sweep = load_benchmark("sweep")
CALIBRATED = ROOT / "benchmarks" / "cluster_e2e_multihot_zipf_50mbit.hardware.json"


def _outcome(seed: int, rates: dict[str, list[float]], estimated: dict[str, float]) -> object:
    """A model whose runs measured `rates` samples/s per round, at 100 ms a step less 10 ms of batch making."""
    runs = {
        run: [{"samples_per_s": r, "step_ms": 1e5 / r + 10.0, "data_ms_per_step": 10.0} for r in per_round]
        for run, per_round in rates.items()
    }
    return sweep.ModelOutcome(runs, estimated, seed, sweep.generate_model(seed, sweep.RANGES), False, 1.0)


def _two_models() -> tuple[object, object]:
    """Model a misses embark's speedup over torchrec by 0.15 (1.25 predicted, 1.1 measured), model b by 0.03."""
    base = {"torchrec-user": [1000.0, 1000.0, 1000.0], "trw": [500.0, 500.0, 500.0]}
    a = _outcome(
        1,
        {"embark": [1100.0, 1300.0, 1200.0], "torchrec": [1000.0, 1000.0, 1100.0], **base},
        {"embark": 80.0, "torchrec": 100.0, "torchrec-user": 100.0, "trw": 200.0},
    )
    b = _outcome(
        2,
        {"embark": [1000.0, 1000.0, 1000.0], "torchrec": [1000.0, 1000.0, 1000.0], **base},
        {"embark": 100.0, "torchrec": 103.0, "torchrec-user": 100.0, "trw": 200.0},
    )
    return a, b


def test_speedups_are_medians_of_round_ratios_and_the_error_is_the_worst_miss() -> None:
    a, b = _two_models()
    # rounds 1.1, 1.3, 1.09: the median of the ratios, not the ratio of the medians (1.2)
    assert a.measured("embark", "torchrec") == pytest.approx(1.1)
    assert a.predicted("embark", "torchrec") == pytest.approx(1.25)
    assert sweep.plan_difference_error([a, b]) == pytest.approx(0.15)  # a: 1.25 - 1.1, b: 1.03 - 1.0
    assert a.estimate_error("embark") == pytest.approx(80.0 / (1e5 / 1200.0) - 1)
    lines = sweep.summary([a, b])
    assert any("worst 0.150" in line and "within 0.07 **not met**" in line for line in lines), lines
    assert sweep.summary([b])[-2].endswith("within 0.07 met")


def test_the_written_hardware_file_plans_with_the_measured_band(tmp_path: Path) -> None:
    """The file plans with the band of measured / predicted speedup over every plan difference (both of TorchRec's
    plans, where embark's differs): the largest shortfall and excess, marked measured, every ratio its measurement,
    and an absolute plan_error the calibrated file held removed (one error, one band)."""
    a, b = _two_models()
    b = dataclasses.replace(b, same_plans=frozenset({frozenset(("embark", "torchrec-user"))}))
    out = tmp_path / "measured.hardware.json"
    document = json.loads(CALIBRATED.read_text())
    document["hardware"]["plan_error"] = 0.3
    calibrated = tmp_path / "calibrated.hardware.json"
    calibrated.write_text(json.dumps(document))
    sweep.write_error(calibrated, out, [a, b])
    hardware = load_hardware(out)
    # a: 1.1 measured / 1.25 predicted over torchrec, 1.2 / 1.25 over torchrec-user; b: 1.0 / 1.03 over torchrec
    assert (hardware.plan_error, hardware.plan_error_below, hardware.plan_error_above) == (0.0, 0.12, 0.0)
    assert hardware == load_hardware(CALIBRATED).with_overrides(plan_error=0.0, plan_error_below=0.12)
    assert (hardware_sources(str(out)) or {})["plan_error_below"] == "measured"
    measured = json.loads(out.read_text())["measurements"]["plan_error_below"]
    assert (measured["min"], measured["max"], measured["samples"]) == (pytest.approx(0.88), pytest.approx(1 / 1.03), 3)
    assert "plan_error" not in json.loads(out.read_text())["measurements"]
    with pytest.raises(ValueError, match="no plan difference measured"):
        sweep.set_plan_band(document, [], "nowhere")


def test_kept_rounds_are_priced_again_with_today_s_cost_model(tmp_path: Path) -> None:
    """--reprice reads a sweep's folder (its settings, each model's spec, hardware file, plans and rounds) and prices
    every plan with the model's hardware file: the same estimates the cost model gives those plans directly, and
    embark's plan counted as TorchRec's where the two are the same."""
    from embark_torchrec.plan import CostModel, Topology, plan_model, table_row_wise_plan

    out = tmp_path / "sweep.md"
    folder = sweep.model_folder(out, 7)
    folder.mkdir(parents=True)
    spec = sweep.generate_model(7, sweep.RANGES)
    topology = Topology(4, 2, load_hardware(CALIBRATED))
    planned = spec.with_batch_size(4 * 512)
    ours = plan_model(planned, topology).plan
    plans = {"embark": ours, "torchrec": ours, "torchrec-user": ours, "trw": table_row_wise_plan(planned, topology)}
    for run, plan in plans.items():
        plan.save(folder / f"{run}.plan.json")
    (folder / "spec.json").write_text(json.dumps(spec.to_dict()))
    (folder / "hardware.json").write_text(CALIBRATED.read_text())
    runs = {run: [{"samples_per_s": 1000.0, "step_ms": 90.0, "data_ms_per_step": 10.0}] for run in plans}
    rounds = {"seed": 7, "world_size": 4, "local_world_size": 2, "batch_size": 512, "seconds": 60.0, "runs": runs}
    (folder / "rounds.json").write_text(json.dumps(rounds))
    settings = {"nodes": 2, "gpus_per_node": 2, "link_mbit": [50.0], "rounds": 1, "steps": 6, "warmup_steps": 4}
    settings["batch_size"] = 512
    (out.with_suffix("") / "sweep.json").write_text(json.dumps(settings | {"hardware": str(CALIBRATED)}))

    outcome = sweep.priced(folder)
    for run, plan in plans.items():
        assert outcome.estimated_ms[run] == CostModel(planned, topology).evaluate(plan).step_ms
    assert outcome.kept_torchrec and outcome.spec == spec and outcome.runs == runs
    assert outcome.same_plans == {frozenset(p) for p in [("embark", "torchrec"), ("embark", "torchrec-user")]} | {
        frozenset(("torchrec", "torchrec-user"))
    }
    assert sweep.main(["--reprice", "--out", str(out)]) == 0
    assert "| 7 |" in out.read_text() and "1 generated models on 2 emulated nodes" in out.read_text()


def test_a_claimed_speedup_is_checked_against_the_band_the_report_printed() -> None:
    """Where embark's plan ran (not TorchRec's), the sweep says whether its measured speedup lay within the band its
    planner's hardware printed (Hardware.speedup_band: points or fractions of the prediction); kept plans and
    unmeasured errors are not claims."""
    from dataclasses import replace

    a, _ = _two_models()  # predicted 1.25, measured 1.1
    calibrated = load_hardware(CALIBRATED).with_overrides(plan_error=0.0)
    inside, outside = (calibrated.with_overrides(plan_error_below=x) for x in (0.15, 0.1))  # from 1.0625, 1.125
    assert replace(a, figures=inside).within_band() and not replace(a, figures=outside).within_band()
    assert replace(a, figures=calibrated.with_overrides(plan_error=0.2)).within_band()
    lines = sweep.summary([replace(a, figures=outside), replace(a, figures=inside)])
    assert lines[-1].endswith("on 1 of 2 models **not met**"), lines
    assert not any("band" in line for line in sweep.summary([a, replace(a, figures=inside, kept_torchrec=True)]))
    assert not replace(a, figures=calibrated).within_band()


def test_a_remeasured_model_is_priced_with_the_new_cluster_file_and_its_own_dense_figures(tmp_path: Path) -> None:
    """--remeasure prices a kept model with the cluster file given (its links, collectives, lookups) and the dense
    figures that model's own file measured: every other field is the new file's, the two dense ones the model's."""
    model = tmp_path / "model.hardware.json"
    document = json.loads(CALIBRATED.read_text())
    document["hardware"] |= {"dense_ms_per_ksample": 123.0, "dense_params_mb": 4.5, "inter_node_bw_gbps": 9e-4}
    model.write_text(json.dumps(document))
    merged = tmp_path / "merged.hardware.json"
    sweep.save_hardware(merged, sweep.with_dense_of(CALIBRATED, model))
    cluster, priced = load_hardware(CALIBRATED), load_hardware(merged)
    assert (priced.dense_ms_per_ksample, priced.dense_params_mb) == (123.0, 4.5)
    assert priced.with_overrides(dense_ms_per_ksample=cluster.dense_ms_per_ksample, dense_params_mb=0.0) == (
        cluster.with_overrides(dense_params_mb=0.0)
    )


def test_remeasure_needs_a_kept_sweep_and_a_cluster_file(tmp_path: Path) -> None:
    """--remeasure without --hardware, or of a markdown without its kept folder, stops before any run, naming it."""
    with pytest.raises(SystemExit):
        sweep.parse_args(["--remeasure", str(tmp_path / "none.md"), "--hardware", str(CALIBRATED)])
    with pytest.raises(SystemExit):
        sweep.parse_args(["--remeasure", str(ROOT / "benchmarks" / "sweep_error.md")])
    args = sweep.parse_args(["--remeasure", str(ROOT / "benchmarks" / "sweep_error.md"), "--hardware", str(CALIBRATED)])
    assert args.remeasure.name == "sweep_error.md"


def test_more_models_join_a_kept_sweep_on_its_settings_and_cluster_file(tmp_path: Path) -> None:
    """--more N draws N fresh seeds and takes the kept sweep's settings and hardware file (the models it adds are
    measured as its were); without a kept sweep, or with a --hardware or --seeds of its own, it stops before any run."""
    kept = {"nodes": 3, "gpus_per_node": 1, "link_mbit": [20.0], "rounds": 3, "steps": 12, "warmup_steps": 2}
    kept |= {"batch_size": 512, "hardware": str(CALIBRATED)}
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "sweep.json").write_text(json.dumps(kept))
    args = sweep.parse_args(["--more", "3", "--out", str(tmp_path / "s.md")])
    assert len(args.seeds) == 3 and args.hardware == CALIBRATED
    assert (args.nodes, args.gpus_per_node, args.link_mbit, args.rounds, args.steps) == (3, 1, [20.0], 3, 12)
    assert (args.warmup_steps, args.batch_size) == (2, 512)
    with pytest.raises(SystemExit):
        sweep.parse_args(["--more", "3", "--out", str(tmp_path / "none.md")])
    with pytest.raises(SystemExit):
        sweep.parse_args(["--more", "3", "--out", str(tmp_path / "s.md"), "--hardware", str(CALIBRATED)])
    with pytest.raises(SystemExit):
        sweep.parse_args(["--more", "3", "--out", str(tmp_path / "s.md"), "--seeds", "5,6"])


def test_a_plan_against_itself_is_1x_and_its_runs_spread_is_shown() -> None:
    """Where embark ran the same plan as a TorchRec run (table by table), their speedup is 1.00x and so is the
    prediction: what the two runs measured apart is the box's spread, shown beside, not counted against the floor or
    the 7 points; a different plan is measured as ever."""
    from dataclasses import replace

    same = frozenset({frozenset(("embark", "torchrec-user"))})
    rates = {"embark": [960.0, 950.0], "torchrec": [1000.0, 1000.0], "torchrec-user": [1000.0, 1000.0]}
    estimated = {"embark": 100.0, "torchrec": 100.0, "torchrec-user": 100.0, "trw": 200.0}
    a = replace(_outcome(3, rates | {"trw": [500.0, 500.0]}, estimated), same_plans=same, kept_torchrec=True)
    assert a.measured("embark", "torchrec-user") == 1.0 and a.runs_apart("embark", "torchrec-user") == 0.955
    assert a.measured("embark", "torchrec") == 0.955  # another plan: measured
    lines = sweep.summary([a])
    assert lines[0].startswith("- embark / torchrec: min 0.95x") and "every model **not met**" in lines[0], lines
    assert lines[1].startswith("- embark / torchrec-user: min 1.00x") and "every model met" in lines[1], lines
    assert any(
        "1 of these comparisons are of a plan with itself" in line and "0.95-0.95x apart" in line for line in lines
    )
    args = sweep.parse_args(["--seeds", "3", "--steps", "4", "--rounds", "2"])
    page = sweep.markdown([a], args, CALIBRATED, 60.0)
    assert "| 0.95x (1.00x) | same plan (runs 0.95x) |" in page, page


def test_measured_seconds_give_each_model_the_steps_that_measure_them_at_embark_s_estimated_step(
    tmp_path: Path,
) -> None:
    """--measured-seconds S: a model's runs take the warm-up, the pipeline's last step and as many steps as S seconds
    hold at embark's estimated step (its kept plan priced with its hardware file), never fewer than
    MIN_MEASURED_STEPS measured nor more than --steps; without it, --steps. The page says what the runs took."""
    from embark_torchrec.plan import CostModel, Topology, plan_model

    folder = sweep.model_folder(tmp_path / "sweep.md", 7)
    folder.mkdir(parents=True)
    spec = sweep.generate_model(7, sweep.RANGES)
    (folder / "spec.json").write_text(json.dumps(spec.to_dict()))
    (folder / "hardware.json").write_text(CALIBRATED.read_text())
    topology = Topology(4, 2, load_hardware(CALIBRATED))
    planned = spec.with_batch_size(4 * 512)
    step_ms = CostModel(planned, topology).evaluate(plan_model(planned, topology).plan).step_ms

    def steps(*flags: str) -> int:
        args = sweep.parse_args(["--seeds", "7", "--batch-size", "512", "--warmup-steps", "4", *flags])
        return sweep.model_steps(args, folder)

    assert steps("--steps", "40") == 40
    held = 12 * step_ms / 1e3  # seconds that hold 12 steps at the estimate
    assert steps("--steps", "40", "--measured-seconds", f"{held * 0.999:.6f}") == 4 + 1 + 12
    assert steps("--steps", "40", "--measured-seconds", f"{held * 1.01:.6f}") == 4 + 1 + 13
    assert steps("--steps", "40", "--measured-seconds", "0.001") == 4 + 1 + sweep.MIN_MEASURED_STEPS
    assert steps("--steps", "20", "--measured-seconds", "1000") == 20
    plan_model(planned, topology).plan.save(folder / "embark.plan.json")  # a kept plan is priced, not planned
    assert steps("--steps", "40", "--measured-seconds", f"{held * 0.999:.6f}") == 4 + 1 + 12
    for bad in (["--measured-seconds", "0"], ["--measured-seconds", "5", "--steps", "12"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(["--seeds", "7", "--warmup-steps", "4", *bad])

    args = sweep.parse_args(["--seeds", "7", "--steps", "24", "--measured-seconds", "30"])
    a, b = _two_models()
    outcomes = [replace_runs(a, 24), replace_runs(b, 13)]
    assert sweep.steps_a_run(args, outcomes).startswith("13-24 steps a run (each model's: 30 s of measured steps")
    args.measured_seconds = None
    assert sweep.steps_a_run(args, outcomes) == "24 steps a run"


def replace_runs(outcome: Any, steps: int) -> Any:
    """The outcome with every run's RESULT saying it took `steps` steps."""
    from dataclasses import replace

    runs = {run: [r | {"steps": steps} for r in rounds] for run, rounds in outcome.runs.items()}
    return replace(outcome, runs=runs)
