"""Embedding clusters: which tables are data-parallel (DP), reduction-based (RB) or unique-based (UB).

Each table is priced alone under the cost model. A DP table adds its all-reduce and local lookups to
every rank; a model-parallel table adds its total (summed over ranks) time, which a balanced plan
spreads over W ranks. So DP wins when its per-rank time is below the model-parallel total / W, and
UB wins over RB when de-duplicated traffic is cheaper than partial sums. RB and UB tables run in
different sharding groups, and a group costs its collectives (CostModel.group_ms) whatever it holds:
so the cheapest of "each table its own choice", "all RB" and "all UB" is taken, the fixed cost of each
group used counted once. DP tables are replicated, so they are accepted smallest first while they fit
in `dp_memory_fraction` of a rank's memory.
"""

from __future__ import annotations

from typing import Mapping

from ..layout.kinds import DATA_PARALLEL_KIND, REDUCTION_KIND, UNIQUE_KIND, cluster_kind
from ..layout.constraints import TableConstraints
from ..cost.model import CostModel
from ..layout.groups import sharding_group
from ..layout.tables import TableLayout
from ..progress import Progress
from ..model.spec import TableSpec

_FREE = TableConstraints()
RB, UB = REDUCTION_KIND.name, UNIQUE_KIND.name  # the model-parallel kinds a free table chooses between


def mean_rank_ms(cost: CostModel, name: str, layout: TableLayout) -> float:
    """The table's time summed over ranks and divided by W: its share of a balanced step."""
    step = cost.step_cost(cost.table_load(name, layout))
    return float(step.rank_load_ms.sum()) / cost.topology.world_size + step.dp_allreduce_ms


def assign_clusters(
    cost: CostModel,
    constraints: Mapping[str, TableConstraints],
    dp_memory_fraction: float = 0.05,
    progress: Progress | None = None,
) -> dict[str, str]:
    clusters: dict[str, str] = {}
    free: list[TableSpec] = []
    for t in cost.spec.tables:
        c = constraints.get(t.name, _FREE)
        if c.layout is not None:
            clusters[t.name] = c.layout.cluster
        elif c.cluster is not None:
            clusters[t.name] = c.cluster
        else:
            free.append(t)
    own_ms = _table_wise_ms(cost, free, progress)
    forced = {(k, cost.table(n).is_sequence) for n, k in clusters.items()}
    clusters.update(_model_parallel_clusters(cost, free, own_ms, forced))
    for t in free:  # a table constrained to TorchRec's (reduction-based) sharding types stays RB
        if not constraints.get(t.name, _FREE).unique_based:
            clusters[t.name] = RB
    dp_candidates: list[tuple[float, str]] = []
    for i, t in enumerate(free):
        if progress is not None:
            progress("data-parallel tables", i, len(free), "")
        if constraints.get(t.name, _FREE).ranks is None:
            dp_ms = mean_rank_ms(cost, t.name, TableLayout.data_parallel())
            if dp_ms < own_ms[t.name][clusters[t.name]]:
                dp_candidates.append((t.rows * cost.row_memory(t.name, t.dim), t.name))
    budget = dp_memory_fraction * cost.topology.hbm_cap_bytes
    used = sum(
        cost.table(n).rows * cost.row_memory(n, cost.table(n).dim)
        for n, c in clusters.items()
        if cluster_kind(c).replicated
    )
    for memory, name in sorted(dp_candidates):
        if used + memory <= budget:
            clusters[name] = DATA_PARALLEL_KIND.name
            used += memory
    return {t.name: clusters[t.name] for t in cost.spec.tables}


def _table_wise(t: TableSpec, cluster: str) -> TableLayout:
    return TableLayout.table_wise(t.rows, t.dim, 0, cluster)


def _table_wise_ms(cost: CostModel, tables: list[TableSpec], progress: Progress | None) -> dict[str, dict[str, float]]:
    """mean_rank_ms of each table table-wise as RB and as UB, priced once: a model may have 50,000
    tables, more than the cost model's cache keeps."""
    ms: dict[str, dict[str, float]] = {}
    for i, t in enumerate(tables):
        if progress is not None:
            progress("clusters", i, len(tables), "")
        ms[t.name] = {k: mean_rank_ms(cost, t.name, _table_wise(t, k)) for k in (RB, UB)}
    return ms


def _model_parallel_clusters(
    cost: CostModel, tables: list[TableSpec], ms: Mapping[str, Mapping[str, float]], forced: set[tuple[str, bool]]
) -> dict[str, str]:
    """RB or UB for each table: per table, all RB or all UB, whichever costs least (`ms`: each
    table's mean_rank_ms in each) with each sharding group used paying its collectives once (groups
    that `forced` tables open anyway are free). Pooled and sequence tables run in different modules,
    so in different groups: a group is a (cluster, sequence?) pair."""
    sequence = {t.name: t.is_sequence for t in tables}
    group = {
        (k, seq): 0.0 if (k, seq) in forced else _group_ms(cost, [t for t in tables if t.is_sequence == seq], k)
        for k in (RB, UB)
        for seq in (False, True)
    }

    def total(choice: dict[str, str]) -> float:
        used = {(k, sequence[n]) for n, k in choice.items()}
        return sum(ms[n][k] for n, k in choice.items()) + sum(group[g] for g in used)

    own = {n: UB if m[UB] < m[RB] else RB for n, m in ms.items()}
    options = [own, dict.fromkeys(ms, RB), dict.fromkeys(ms, UB)]
    return min(options, key=total)  # the first on a tie: each table its own choice


def _group_ms(cost: CostModel, tables: list[TableSpec], cluster: str) -> float:
    if not tables:
        return 0.0
    t = tables[0]
    topology = cost.topology
    layout = _table_wise(t, cluster)
    return cost.group_ms(sharding_group(layout, t.rows, topology.world_size, topology.local_world_size, t.is_sequence))
