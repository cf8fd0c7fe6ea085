"""benchmarks/speedup_repeat.py on a kept sweep made up here: the repeat's row puts the speedup the new rounds measured
(the median of their per-round ratios) beside the sweep's and the cost model's prediction for the same plans, and
seeds the sweep did not keep are refused before anything runs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from embark_torchrec.plan.model.hardware_file import load_hardware
from tests.support.benchmarks import load_benchmark, made_up_sweep
from tests.support.processes import ROOT

repeat = load_benchmark("speedup_repeat")
sweep = load_benchmark("sweep")
CALIBRATED = ROOT / "benchmarks" / "cluster_e2e_multihot_zipf_50mbit.hardware.json"


def test_the_repeat_reports_the_new_rounds_speedup_beside_the_sweep_s_and_the_prediction(tmp_path: Path) -> None:
    kept = made_up_sweep(tmp_path, (3,), load_hardware(CALIBRATED), CALIBRATED, torchrec_is_trw=True)
    folder = sweep.model_folder(kept, 3)
    swept = sweep.priced(folder)
    embark_rate = swept.runs["embark"][0]["samples_per_s"]
    torchrec_rate = swept.runs["torchrec"][0]["samples_per_s"]
    ratios = [1.30, 1.36, 1.25]  # the new rounds' embark / torchrec samples/s
    again = {
        "embark": [{"samples_per_s": embark_rate}] * 3,
        "torchrec": [{"samples_per_s": embark_rate / r} for r in ratios],
    }
    out = tmp_path / "repeat.md"
    out.with_suffix("").mkdir()
    (out.with_suffix("") / "seed3.json").write_text(json.dumps({"seed": 3, "runs": again, "seconds": 60.0}))

    assert repeat.main(["--sweep", str(kept), "--out", str(out), "--kept"]) == 0
    predicted = swept.predicted("embark", "torchrec")
    measured = embark_rate / torchrec_rate
    assert measured == swept.measured("embark", "torchrec") != predicted  # its steps hold batch making too
    row = next(line for line in out.read_text().splitlines() if line.startswith("| 3 |"))
    again_speedup = statistics.median(ratios)
    assert row == (
        f"| 3 | {predicted:.3f}x | {measured:.3f}x ({measured:.3f}) | {again_speedup:.3f}x (1.300, 1.360, 1.250) | "
        f"{again_speedup - measured:+.3f} | {abs(predicted - measured):.3f}, {abs(predicted - again_speedup):.3f} |"
    )
    assert "--kept" not in out.read_text()  # its rerun line runs the plans again


def test_seeds_the_sweep_did_not_keep_are_refused_before_any_run(tmp_path: Path, capsys) -> None:
    kept = made_up_sweep(tmp_path, (3,), load_hardware(CALIBRATED), CALIBRATED)
    with pytest.raises(SystemExit):
        repeat.parse_args(["--sweep", str(kept), "--seeds", "3,4"])
    assert "--seeds [4]: not models" in capsys.readouterr().err
