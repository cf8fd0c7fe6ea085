"""Embedding clusters: which tables are data-parallel (DP), reduction-based (RB) or unique-based (UB).

Each table is priced alone under the cost model. A DP table adds its all-reduce and local lookups to
every rank; a model-parallel table adds its total (summed over ranks) time, which a balanced plan
spreads over W ranks. So DP wins when its per-rank time is below the model-parallel total / W, and
UB wins over RB when de-duplicated traffic is cheaper than partial sums. DP tables are replicated, so
they are accepted smallest first while they fit in `dp_memory_fraction` of a rank's memory.
"""

from __future__ import annotations

from typing import Mapping

from .constraints import TableConstraints
from .cost import CostModel
from .layout import TableLayout
from .spec import TableSpec


def mean_rank_ms(cost: CostModel, name: str, layout: TableLayout) -> float:
    """The table's time summed over ranks and divided by W: its share of a balanced step."""
    step = cost.step_cost(cost.table_load(name, layout))
    return float(step.rank_load_ms.sum()) / cost.topology.world_size + step.dp_allreduce_ms


def assign_clusters(
    cost: CostModel,
    constraints: Mapping[str, TableConstraints],
    dp_memory_fraction: float = 0.05,
) -> dict[str, str]:
    clusters: dict[str, str] = {}
    dp_candidates: list[tuple[float, str]] = []
    for t in cost.spec.tables:
        c = constraints.get(t.name, TableConstraints())
        if c.layout is not None:
            clusters[t.name] = c.layout.cluster
            continue
        if c.cluster is not None:
            clusters[t.name] = c.cluster
            continue
        clusters[t.name] = _cheaper_model_parallel(cost, t)
        if c.ranks is None:
            dp_ms = mean_rank_ms(cost, t.name, TableLayout.data_parallel())
            if dp_ms < mean_rank_ms(cost, t.name, _table_wise(t, clusters[t.name])):
                dp_candidates.append((t.rows * cost.row_memory(t.name, t.dim), t.name))
    budget = dp_memory_fraction * cost.topology.hbm_cap_bytes
    used = sum(cost.table(n).rows * cost.row_memory(n, cost.table(n).dim) for n, c in clusters.items() if c == "dp")
    for memory, name in sorted(dp_candidates):
        if used + memory <= budget:
            clusters[name] = "dp"
            used += memory
    return clusters


def _table_wise(t: TableSpec, cluster: str) -> TableLayout:
    return TableLayout.table_wise(t.rows, t.dim, 0, cluster)


def _cheaper_model_parallel(cost: CostModel, t: TableSpec) -> str:
    rb = mean_rank_ms(cost, t.name, _table_wise(t, "rb"))
    ub = mean_rank_ms(cost, t.name, _table_wise(t, "ub"))
    return "ub" if ub < rb else "rb"
