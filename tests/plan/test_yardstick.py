"""benchmarks/yardstick.py, the independent search plan_quality measures the planner against: it keeps
only valid plans (every table tiled, memory caps, the tables' allowed ranks), is never worse than the
best of its seeds, and is a function of its seed."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from embark_torchrec.plan.search.baselines import table_row_wise_plan
from embark_torchrec.plan.layout.constraints import TableConstraints
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology
from tests.support.benchmarks import load_benchmark
from tests.support.specs import with_memory

EVALUATIONS = 600


def _yardstick() -> ModuleType:
    return load_benchmark("yardstick")


def _case() -> CostModel:
    """A hot big table (which must be cut to fit a rank's 2 GB), a few medium and tiny tables, on 2
    nodes of 2 GPUs."""
    tables = (
        TableSpec("hot", 3_000_000, 128, 40.0),
        TableSpec("mid0", 200_000, 64, 8.0),
        TableSpec("mid1", 150_000, 64, 6.0),
        *(TableSpec(f"tiny{i}", 50 + 40 * i, 16, 1.0 + i % 3) for i in range(6)),
    )
    spec = ModelSpec("yardstick-test", 4096, tables, IdDistribution("zipf", 1.1))
    hardware = with_memory(2.0)
    return CostModel(spec, Topology(4, 2, hardware))


def _run(cost: CostModel, seed: int = 0, constraints: dict[str, TableConstraints] | None = None):
    ys = _yardstick()
    seeds = {"TWRW": table_row_wise_plan(cost.spec, cost.topology)}
    if constraints is None:
        seeds["embark"] = plan_model(cost.spec, cost.topology, progress=False).plan
    search = ys.Yardstick(cost, ys.YardstickConfig(evaluations=EVALUATIONS, seed=seed), constraints)
    return search, search.run(seeds)


def test_plans_are_valid_and_no_worse_than_the_seeds() -> None:
    cost = _case()
    search, result = _run(cost)
    step = cost.evaluate(result.plan)
    result.plan.validate(cost.spec, step.rank_memory, cost.topology.hbm_cap_bytes)  # raises when invalid
    assert step.rank_memory.max() <= cost.topology.hbm_cap_bytes
    hot = result.plan["hot"]
    assert hot.cluster == "dp" or hot.num_row_slices * hot.num_col_slices > 1  # whole, it exceeds a rank's memory
    for name, layout in result.plan.tables.items():
        assert search.allows(name, layout) is None, name
    starts = [s.start_ms for s in result.seeds if s.start_ms is not None]
    assert len(starts) >= 2  # TWRW and embark's plan are valid seeds
    assert result.step.step_ms <= min(starts) + 1e-12
    assert result.step.step_ms == step.step_ms
    assert result.evaluations >= EVALUATIONS


def test_deterministic_given_a_seed() -> None:
    cost = _case()
    _, a = _run(cost, seed=3)
    _, b = _run(_case(), seed=3)
    assert a.plan.to_dict() == b.plan.to_dict()
    assert a.step.step_ms == b.step.step_ms
    assert a.accepted == b.accepted


def test_allowed_ranks_and_clusters_are_kept() -> None:
    cost = _case()
    constraints = {
        "mid0": TableConstraints(ranks=(2, 3)),
        "hot": TableConstraints(cluster="rb", column_cuts=False),
        "tiny0": TableConstraints(unique_based=False),
    }
    _, result = _run(cost, constraints=constraints)
    assert result.plan["mid0"].used_ranks() <= {2, 3}
    assert result.plan["hot"].cluster == "rb" and result.plan["hot"].num_col_slices == 1
    assert result.plan["tiny0"].cluster != "ub"


def test_comm_imbalance_is_max_over_mean() -> None:
    cost = _case()
    step = cost.evaluate(table_row_wise_plan(cost.spec, cost.topology))
    comm = step.rank_intra_ms + step.rank_inter_ms
    assert np.isclose(_yardstick().comm_imbalance(step), comm.max() / comm.mean())
