"""plan_model: the whole EMBark planning pipeline on a model spec, with no torchrec import."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping

from .baselines import table_row_wise_plan
from .clusters import assign_clusters
from .constraints import TableConstraints
from .cost import CostModel, OptimizerMemory, StepCost
from .layout import Plan
from .search import GreedySearch, SearchConfig, SearchStats
from .spec import ModelSpec
from .topology import Topology


@dataclass(frozen=True)
class PlannedModel:
    """A plan with what it was planned for and what it is estimated to cost."""

    spec: ModelSpec
    topology: Topology
    plan: Plan
    cost: StepCost
    seconds: float
    clusters: Mapping[str, str] = field(default_factory=dict)
    stats: SearchStats | None = None


def plan_model(
    spec: ModelSpec,
    topology: Topology,
    constraints: Mapping[str, TableConstraints] | None = None,
    config: SearchConfig | None = None,
    optimizer: OptimizerMemory | None = None,
) -> PlannedModel:
    """Clusters, then the greedy 3D search; the result is validated against every invariant.

    The search is greedy, so without constraints its plan is also compared with the table-row-wise
    baseline (EMBark's reference layout), and the cheaper of the two that fits memory is returned."""
    start = time.perf_counter()
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - {t.name for t in spec.tables})
    if unknown:
        raise ValueError(f"constraints name tables the model does not have: {unknown}")
    config = config or SearchConfig()
    cost = CostModel(spec, topology, optimizer)
    clusters = assign_clusters(cost, constraints, config.dp_memory_fraction)
    search = GreedySearch(cost, clusters, constraints, config)
    plan = search.run()
    step = cost.evaluate(plan)
    if not constraints:
        baseline = table_row_wise_plan(spec, topology)
        base_step = cost.evaluate(baseline)
        if base_step.step_ms < step.step_ms and base_step.rank_memory.max() <= topology.hbm_cap_bytes:
            plan, step = baseline, base_step
            clusters = {t.name: "rb" for t in spec.tables}
    plan.validate(spec, step.rank_memory, topology.hbm_cap_bytes)
    return PlannedModel(spec, topology, plan, step, time.perf_counter() - start, clusters, search.stats)
