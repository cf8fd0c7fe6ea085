"""benchmarks/plan_band.py on two kept sweeps made up here, whose steps ran with a dense part four times the one
their files price: the band it writes is the largest shortfall and excess of measured over predicted speedup over
every plan difference of both sweeps (a plan run against itself is none), and the planner plans with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from embark_torchrec.plan.model.hardware_file import hardware_sources, load_hardware
from tests.support.benchmarks import load_benchmark, made_up_sweep
from tests.support.processes import ROOT

band = load_benchmark("plan_band")
sweep = load_benchmark("sweep")
CALIBRATED = ROOT / "benchmarks" / "cluster_e2e_multihot_zipf_50mbit.hardware.json"


def _sweeps(tmp_path: Path) -> list[Path]:
    calibrated = load_hardware(CALIBRATED)
    truth = calibrated.with_overrides(dense_ms_per_ksample=4 * calibrated.dense_ms_per_ksample)
    return [
        made_up_sweep(tmp_path / name, seeds, truth, CALIBRATED, torchrec_is_trw=True)
        for name, seeds in (("a", (3, 11)), ("b", (5,)))
    ]


def test_the_pooled_band_is_the_extremes_of_every_plan_difference_of_every_sweep(tmp_path: Path) -> None:
    sweeps = _sweeps(tmp_path)
    outcomes = [o for s in sweeps for o in band.kept_outcomes(s)]
    # embark's plan differs from torchrec's (table-row-wise here), not from torchrec-user's (the same plan)
    ratios = [o.measured("embark", "torchrec") / o.predicted("embark", "torchrec") for o in outcomes]
    assert sweep.speedup_ratios(outcomes) == pytest.approx(ratios) and len(ratios) == 3
    assert max(abs(r - 1) for r in ratios) > 0.01  # the dense part's error moves the speedups off their prediction
    out = tmp_path / "band.hardware.json"
    assert band.main(["--sweeps", ",".join(map(str, sweeps)), "--hardware", str(CALIBRATED), "--out", str(out)]) == 0
    written = load_hardware(out)
    below, above = round(max(0.0, 1 - min(ratios)), 4), round(max(0.0, max(ratios) - 1), 4)
    assert (written.plan_error, written.plan_error_below, written.plan_error_above) == (0.0, below, above)
    assert written == load_hardware(CALIBRATED).with_overrides(plan_error=0.0, plan_error_below=below,
                                                               plan_error_above=above)  # fmt: skip
    assert (hardware_sources(str(out)) or {})["plan_error_below"] == "measured"
    assert written.speedup_band(1.2) == pytest.approx((1.2 * (1 - below), 1.2 * (1 + above)))


def test_a_bad_hardware_file_or_no_kept_sweep_stops_before_anything_is_written(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit):
        band.parse_args(["--sweeps", "x.md", "--hardware", str(bad), "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="no kept sweep"):
        band.main(["--sweeps", str(tmp_path / "none.md"), "--hardware", str(CALIBRATED), "--out", str(bad)])
    assert bad.read_text() == "{"
