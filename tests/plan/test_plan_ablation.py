"""benchmarks/plan_ablation.py on sweep 7's kept model 1199748406 (its spec, hardware file and plans) with rounds made
up here: each swap puts back exactly TorchRec's layouts of its tables, a --plan runs as given, each change is measured
over embark's plan round by round and as medians, its error is the priced change less the measured one, and a swap of
a table the two plans lay out alike, or a --plan of another model or shape, is refused before anything runs (the runs
need the emulated cluster: `make test` starts none)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from embark_torchrec.plan import CostModel, ModelSpec, Plan, Topology
from embark_torchrec.plan.layout.tables import TableLayout
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
    embark = _plans()[0]
    t4_table_wise = embark.replace_table("t4", TableLayout.table_wise(6205, 64, 0))
    names = ablation.prepare(SWEEP, SEED, swaps, folder, {"t4-tw": t4_table_wise})
    assert names == ["embark", "torchrec", "swap-t4", "swap-t5+t6", "plan-t4-tw"]
    assert Plan.load(folder / "plan-t4-tw.plan.json").tables == t4_table_wise.tables
    measured = {"embark": [1200, 1220, 1210], "torchrec": [1700, 1690, 1710], "swap-t4": [1480, 1520, 1500],
                "swap-t5+t6": [1450, 1470, 1460], "plan-t4-tw": [1330, 1310, 1320]}  # fmt: skip
    kept = {"seed": SEED, "sweep": "benchmarks/sweep7.md", "world_size": 4, "local_world_size": 2,
            "batch_size": 2048, "seconds": 120.0, "swaps": [list(s) for s in swaps], "plans": ["t4-tw"],
            "runs": {run: [_run(ms) for ms in steps] for run, steps in measured.items()}}  # fmt: skip
    (folder / "rounds.json").write_text(json.dumps(kept))

    split = ablation.ablation_of(folder)
    spec = ModelSpec.from_dict(json.loads((SOURCE / "spec.json").read_text())).with_batch_size(2048 * 4)
    cost = CostModel(spec, Topology(4, 2, load_hardware(SOURCE / "hardware.json")))
    embark_priced = cost.evaluate(_plans()[0]).step_ms
    t4 = split.swaps[0]
    assert t4.run == "swap-t4"
    t4_priced = cost.evaluate(Plan.load(folder / "swap-t4.plan.json")).step_ms
    assert t4.priced_change_ms == pytest.approx(t4_priced - embark_priced)
    assert t4.measured_change_ms == statistics.median(measured["swap-t4"]) - statistics.median(measured["embark"])
    assert t4.round_changes_ms == [280, 300, 290]
    assert t4.error_ms == pytest.approx(t4.priced_change_ms - 290)
    assert split.measured == pytest.approx(1700 / 1210)
    assert t4.label == "t4: rb hierarchical 2x1 on [0] -> dp"
    assert split.swaps[1].label == "t5: ub 1x1 on [3] -> dp; t6: ub 3x1 on [1, 3] -> dp"
    (tw,) = split.given
    assert tw.label == "t4: rb hierarchical 2x1 on [0] -> rb 1x1 on [0]"
    assert tw.priced_change_ms == pytest.approx(cost.evaluate(t4_table_wise).step_ms - embark_priced)
    assert (tw.measured_change_ms, tw.round_changes_ms) == (110, [130, 90, 110])

    assert ablation.main(["--kept", "--out", str(out)]) == 0
    text = out.read_text()
    assert f"## Seed {SEED}: embark / torchrec {1700 / 1210:.3f}x measured" in text
    assert (
        f"| TorchRec's layout | {t4_priced:,.0f} | 1,500 | {t4.priced_change_ms:+,.0f} | +290 (+280, +300, +290)"
        in text
    )
    assert (
        f"| --plan t4-tw | {tw.priced_ms:,.0f} | 1,320 | {tw.priced_change_ms:+,.0f} | +110 (+130, +90, +110)" in text
    )
    # the whole difference's error beside the swaps' sum (the --plan's not in it)
    assert f"the swaps' errors add up to {t4.error_ms + split.swaps[1].error_ms:+,.0f} ms" in text


def test_a_swap_of_a_table_both_plans_lay_out_alike_is_refused_before_any_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        ablation.parse_args(["--sweep", str(SWEEP), "--seed", str(SEED), "--swap", "t4,t1"])
    assert "--swap t4,t1: ['t1'] not a table whose layout differs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("source", "refusal"),
    [
        (
            SWEEP.with_suffix("").parent / "sweep6" / "seed768868022" / "embark.plan.json",
            "that the model does not have",
        ),
        (SOURCE / "embark.plan.json", "lays out every table as embark's plan does"),
        (None, "is for (ranks, ranks per node) (8, 2); the model ran on (4, 2)"),
    ],
)
def test_a_plan_of_another_model_or_cluster_or_embark_s_own_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: Path | None, refusal: str
) -> None:
    if source is None:  # embark's plan of this model, laid out for 8 ranks
        data = _plans()[0].to_dict()
        data["world_size"] = 8
        data["tables"]["t4"] = {"cluster": "dp", "precision": {"forward": "fp32", "backward": "fp32"}, "shards": []}
        source = tmp_path / "wider.plan.json"
        source.write_text(json.dumps(data))
    with pytest.raises(SystemExit):
        ablation.parse_args(["--sweep", str(SWEEP), "--seed", str(SEED), "--plan", f"other={source}"])
    err = capsys.readouterr().err
    assert f"--plan other={source}" in err and refusal in err
