"""benchmarks/plan_ablation.py on sweep 7's kept model 1199748406 (its spec, hardware file and plans) with rounds made
up here: each swap puts back exactly TorchRec's layouts of its tables, its measured change is over embark's plan round
by round and as medians, its error is the priced change less the measured one, and a swap of a table the two plans
lay out alike is refused before anything runs (the runs need the emulated cluster: `make test` starts none)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from embark_torchrec.plan import CostModel, ModelSpec, Plan, Topology
from embark_torchrec.plan.model.hardware_file import load_hardware
from tests.support.benchmarks import load_benchmark
from tests.support.processes import ROOT

ablation = load_benchmark("plan_ablation")
SWEEP = ROOT / "benchmarks" / "sweep7.md"
SEED = 1199748406
SOURCE = SWEEP.with_suffix("") / f"seed{SEED}"


def _plans() -> tuple[Plan, Plan]:
    return Plan.load(SOURCE / "embark.plan.json"), Plan.load(SOURCE / "torchrec.plan.json")


def test_swaps_put_back_torchrec_s_layouts_of_their_tables_and_nothing_else() -> None:
    embark, torchrec = _plans()
    differing = ablation.differing_tables(embark, torchrec)
    assert differing == ["t0", "t4", "t5", "t6"]
    assert ablation.swapped(embark, torchrec, tuple(differing)).tables == torchrec.tables
    one = ablation.swapped(embark, torchrec, ("t4",))
    assert [t for t in one.tables if one.tables[t] != embark.tables[t]] == ["t4"]
    assert one.tables["t4"] == torchrec.tables["t4"]


def _run(step_ms: float) -> dict[str, float]:
    return {"step_ms": step_ms + 10.0, "data_ms_per_step": 10.0}


def test_each_swap_is_priced_and_measured_against_embark_s_plan_round_by_round(tmp_path: Path) -> None:
    out = tmp_path / "ablation.md"
    folder = out.with_suffix("") / f"seed{SEED}"
    swaps = [("t4",), ("t5", "t6")]
    names = ablation.prepare(SWEEP, SEED, swaps, folder)
    assert names == ["embark", "torchrec", "swap-t4", "swap-t5+t6"]
    measured = {"embark": [1200, 1220, 1210], "torchrec": [1700, 1690, 1710], "swap-t4": [1480, 1520, 1500],
                "swap-t5+t6": [1450, 1470, 1460]}  # fmt: skip
    kept = {"seed": SEED, "sweep": "benchmarks/sweep7.md", "world_size": 4, "local_world_size": 2,
            "batch_size": 2048, "seconds": 120.0, "swaps": [list(s) for s in swaps],
            "runs": {run: [_run(ms) for ms in steps] for run, steps in measured.items()}}  # fmt: skip
    (folder / "rounds.json").write_text(json.dumps(kept))

    split = ablation.ablation_of(folder)
    spec = ModelSpec.from_dict(json.loads((SOURCE / "spec.json").read_text())).with_batch_size(2048 * 4)
    cost = CostModel(spec, Topology(4, 2, load_hardware(SOURCE / "hardware.json")))
    embark_priced = cost.evaluate(_plans()[0]).step_ms
    t4 = split.swaps[0]
    assert t4.tables == ("t4",)
    t4_priced = cost.evaluate(Plan.load(folder / "swap-t4.plan.json")).step_ms
    assert t4.priced_change_ms == pytest.approx(t4_priced - embark_priced)
    assert t4.measured_change_ms == statistics.median(measured["swap-t4"]) - statistics.median(measured["embark"])
    assert t4.round_changes_ms == [280, 300, 290]
    assert t4.error_ms == pytest.approx(t4.priced_change_ms - 290)
    assert split.measured == pytest.approx(1700 / 1210)
    assert "t4: rb hierarchical 2x1 on [0] -> dp" in t4.labels
    assert split.swaps[1].labels.startswith("t5: ub 1x1 on [3] -> dp; t6: ub 3x1 on [1, 3] -> dp")

    assert ablation.main(["--kept", "--out", str(out)]) == 0
    text = out.read_text()
    assert f"## Seed {SEED}: embark / torchrec {1700 / 1210:.3f}x measured" in text
    assert f"{t4.priced_change_ms:+,.0f} | +290 (+280, +300, +290) | {t4.error_ms:+,.0f} |" in text


def test_a_swap_of_a_table_both_plans_lay_out_alike_is_refused_before_any_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        ablation.parse_args(["--sweep", str(SWEEP), "--seed", str(SEED), "--swap", "t4,t1"])
    assert "--swap t4,t1: ['t1'] not a table whose layout differs" in capsys.readouterr().err
