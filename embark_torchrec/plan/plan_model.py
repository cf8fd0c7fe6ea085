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
from .report import Progress, progress_line
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
    progress: bool | Progress | None = None,
) -> PlannedModel:
    """Clusters, then the greedy 3D search; the result is validated against every invariant.

    The search is greedy, so without constraints its plan is also compared with the table-row-wise
    baseline (EMBark's reference layout), and the cheaper of the two that fits memory is returned.

    progress: a Progress to call as planning goes; True draws a ProgressLine on stderr, False
    nothing, None (the default) a ProgressLine when stderr is a terminal (it shows only once
    planning has taken a few seconds)."""
    start = time.perf_counter()
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - {t.name for t in spec.tables})
    if unknown:
        raise ValueError(f"constraints name tables the model does not have: {unknown}")
    own_line = progress is None or isinstance(progress, bool)
    line = progress_line(progress, f"planning {spec.name}") if own_line else None
    report = line if own_line else progress
    try:
        config = config or SearchConfig()
        cost = CostModel(spec, topology, optimizer)
        clusters = assign_clusters(cost, constraints, config.dp_memory_fraction, report)
        search = GreedySearch(cost, clusters, constraints, config, report)
        plan = search.run()
        clusters = {name: layout.cluster for name, layout in plan.tables.items()}  # phase 3 may re-cluster
        if report is not None:
            report("scoring", 0, None, "")
        step = cost.evaluate(plan)
        if not constraints:
            baseline = table_row_wise_plan(spec, topology)
            base_step = cost.evaluate(baseline)
            if base_step.step_ms < step.step_ms and base_step.rank_memory.max() <= topology.hbm_cap_bytes:
                plan, step = baseline, base_step
                clusters = {t.name: "rb" for t in spec.tables}
        plan.validate(spec, step.rank_memory, topology.hbm_cap_bytes)
    finally:
        if line is not None:
            line.close()
    return PlannedModel(spec, topology, plan, step, time.perf_counter() - start, clusters, search.stats)
