"""The planner's guarantees: plan_model never returns a plan its own cost model prices slower than
table-row-wise or than a candidate it is given (EmbarkPlanner gives TorchRec's default plan), on
every case of benchmarks/plan_quality.py, TorchRec's plans read from benchmarks/cache/ (no TorchRec
planning run). The search runs on a small budget here: the guarantee must hold whatever the search
finds, and a weaker search makes the baselines win more often."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embark_torchrec.plan.search.baselines import table_row_wise_plan
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.tables import Plan
from embark_torchrec.plan.plan_model import EMBARK, TABLE_ROW_WISE, plan_model
from embark_torchrec.plan.search.config import SearchConfig
from embark_torchrec.plan.model.spec import ModelSpec, builtin_model, load_model_spec
from embark_torchrec.plan.model.topology import PRESETS, Topology

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# benchmarks/plan_quality.py's DEFAULT_CASES: the public models at 64 and 128 GPUs, the adversarial ones
CASES = [(m, w, 8) for m in ("dcnv2", "t180", "t200", "t510") for w in (64, 128)] + [
    ("skewed_dcnv2", 24, 8),
    ("skewed_dcnv2", 128, 8),
    ("tiny_big", 16, 4),
    ("tiny_big", 64, 8),
    ("mixed300", 32, 8),
    ("mixed300", 96, 8),
]
BATCH = 65536
WEAK = SearchConfig(patience=2, polish_moves=0, improve_evaluations=0)


def _spec(model: str, world: int) -> ModelSpec:
    path = BENCHMARKS / "models" / f"{model}.json"
    spec = load_model_spec(path) if path.exists() else builtin_model(model)
    return spec.with_batch_size(BATCH // world * world)


def _torchrec(model: str, topology: Topology) -> dict[str, Plan]:
    """TorchRec's default plan of the case, as plan_quality cached it (none where its planner timed out)."""
    path = BENCHMARKS / "cache" / f"torchrec_{model}_{topology.world_size}x{topology.local_world_size}_dgx-h100.json"
    entry = json.loads(path.read_text())
    return {"torchrec": Plan.from_dict(entry["plan"])} if entry["status"] == "ok" else {}


@pytest.mark.parametrize("model,world,local", CASES, ids=[f"{m}@{w}x{lw}" for m, w, lw in CASES])
def test_never_slower_than_table_row_wise_or_torchrec(model: str, world: int, local: int) -> None:
    """The plan returned is priced at most table-row-wise's and TorchRec's default plan's step (where
    TorchRec planned), and is the baseline's own plan when the search's is slower."""
    spec = _spec(model, world)
    topology = Topology(world, local, PRESETS["dgx-h100"])
    candidates = _torchrec(model, topology)
    for plan in candidates.values():
        assert set(plan.tables) == {t.name for t in spec.tables}  # the cache is of this model
    planned = plan_model(spec, topology, config=WEAK, progress=False, candidates=candidates)
    cost = CostModel(spec, topology)
    baselines = {TABLE_ROW_WISE: table_row_wise_plan(spec, topology), **candidates}
    steps = {name: cost.evaluate(plan).step_ms for name, plan in baselines.items()}
    assert cost.evaluate(planned.plan).step_ms == planned.cost.step_ms
    for name, ms in steps.items():
        assert planned.cost.step_ms <= ms, name
    if planned.source != EMBARK:
        assert planned.plan.tables == baselines[planned.source].tables


def test_a_faster_candidate_is_returned_and_one_breaking_constraints_is_not() -> None:
    """A candidate priced faster than the search's plan is what plan_model returns (named as its
    source); under a constraint it breaks, it is passed over."""
    from embark_torchrec.plan.layout.constraints import TableConstraints

    spec = _spec("dcnv2", 64)
    topology = Topology(64, 8, PRESETS["dgx-h100"])
    best = plan_model(spec, topology, progress=False).plan
    weak = plan_model(
        spec,
        topology,
        config=SearchConfig(max_rounds=0, polish_moves=0, improve_evaluations=0),
        progress=False,
        candidates={"better": best},
    )
    assert weak.source == "better" and weak.plan.tables == best.tables
    name = next(n for n, layout in best.tables.items() if layout.cluster != "dp")
    pinned = {name: TableConstraints(cluster="dp" if best.tables[name].cluster != "dp" else "rb")}
    constrained = plan_model(
        spec,
        topology,
        pinned,
        SearchConfig(max_rounds=0, polish_moves=0, improve_evaluations=0),
        progress=False,
        candidates={"better": best},
    )
    assert constrained.source != "better"
