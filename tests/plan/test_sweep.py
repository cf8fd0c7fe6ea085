"""benchmarks/sweep.py's arithmetic, on rounds made up here: the speedups are medians of per-round ratios, the error on
plan differences is the worst |predicted - measured| speedup of embark over torchrec, and the hardware file it writes
plans with that error (the runs themselves need the emulated cluster: `make test` does not start one)."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_the_written_hardware_file_plans_with_the_measured_error(tmp_path: Path) -> None:
    """The file plans with the worst miss, marked measured, and keeps every model's miss as its measurement."""
    out = tmp_path / "measured.hardware.json"
    sweep.write_error(CALIBRATED, out, list(_two_models()))
    hardware = load_hardware(out)
    assert hardware.plan_error == 0.15
    assert hardware == load_hardware(CALIBRATED).with_overrides(plan_error=0.15)
    assert (hardware_sources(str(out)) or {})["plan_error"] == "measured"
    measured = json.loads(out.read_text())["measurements"]["plan_error"]
    assert (measured["min"], measured["max"], measured["samples"]) == (pytest.approx(0.03), pytest.approx(0.15), 2)
    assert measured["median"] == pytest.approx(0.09)
