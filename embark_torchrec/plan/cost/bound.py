"""A lower bound on the estimated step time of any plan of a model, under the cost model.

The step is the slowest rank's lookups + the slowest rank's communication + collectives + DP
all-reduce + dense - the all-reduces' overlap with the backward (at most the backward's share h of
the lookups and dense compute, and at most the all-reduces). A maximum is at least the mean, and a
rank's max(sent, received) at least their mean, so with L = sum of lookups / W, C = sum of
(sent + received) / 2 / W and D the dense compute

    step >= max(L + C + D,  (1 - h) (L + D) + C + DP all-reduce + dense all-reduce)  +  collectives

(with host_cores, the lookups also take at least their sum / host_cores). The DP all-reduce takes
its slower link's time (or both links' sum): at least any mix m x intra + (1 - m) x inter of them,
and the bound is the best of a few mixes. Then every term but dense is a sum over tables, so each
table is priced at its own cheapest option: any cluster its constraints allow, and its fewest
slices (more row or column slices only add IDs, lengths and partial sums to the sums; the one
exception, 8-byte IDs on TorchRec's own sharding types against our 4-byte ones, is covered by also
pricing two row slices of ours). Collectives cost at least the groups of fixed layouts, or the
cheapest group any table must join.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..layout.constraints import TableConstraints
from .model import BACKWARD_COMPUTE_MULTIPLIER, CostModel
from .load import RankLoad
from ..layout.groups import ShardingGroup
from ..layout.kinds import DATA_PARALLEL_KIND, REDUCTION_KIND, UNIQUE_KIND, cluster_kind
from ..layout.tables import TableLayout, WirePrecision
from ..progress import Progress

_FREE = TableConstraints()
_DP_MIXES = (0.0, 0.25, 0.5, 0.75, 1.0)


def allowed_clusters(constraints: TableConstraints) -> tuple[str, ...]:
    """The clusters a table may go to: its forced one, else DP (when every rank is allowed), RB,
    and UB unless it must keep TorchRec's sharding types."""
    if constraints.layout is not None:
        return (constraints.layout.cluster,)
    if constraints.cluster is not None:
        return (constraints.cluster,)
    dp = (DATA_PARALLEL_KIND.name,) if constraints.ranks is None else ()
    return dp + (REDUCTION_KIND.name,) + ((UNIQUE_KIND.name,) if constraints.unique_based else ())


def _parts_ms(cost: CostModel, loads: list[RankLoad]) -> np.ndarray:
    """Per load: a table's lookups and communication summed over ranks (each rank's max(sent, received)
    taken as their mean, in every phase: CostModel.both_ways never undercuts it while the one-way ratio is at most 2,
    and a sum over phases never undercuts the phases' sum priced at once), in ms,
    and its DP all-reduce's ms were it all intra-node, or all inter-node.
    The loads are priced stacked (rows [14, load, W]), each element as CostModel.rank_times prices it. The
    paired bytes' premium takes their mean too where it is a cost; where pairs run faster (a negative premium)
    it takes their sum, which no rank's max(sent, received) exceeds."""
    even = RankLoad(np.stack([load.rows for load in loads], axis=1))
    pairs = (
        ("send_intra", "recv_intra"),
        ("send_inter", "recv_inter"),
        ("send_paired", "recv_paired"),
        ("send_inter_ids", "recv_inter_ids"),
        ("send_inter_grads", "recv_inter_grads"),
    )
    for send, recv in pairs:
        both = getattr(even, send) + getattr(even, recv)
        mean = both if send == "send_paired" and cost.paired_premium_ms_per_byte < 0 else both / 2
        setattr(even, send, mean)
        setattr(even, recv, mean)
    lookup, intra, inter = cost.rank_times(even.rows)
    solo = min(cost.topology.hardware.inter_node_solo_ratio, cost.topology.local_world_size)
    if solo > 1.0:  # on a shared link a rank runs at most `solo` x the all-ranks rate (CostModel.shared_link_inter_ms)
        plain = cost.network_ms(even.send_inter, even.recv_inter)
        inter = plain / solo + (inter - plain)
    dp = [
        (float(cost.ring_allreduce_ms(load.dp_intra, 0.0)), float(cost.ring_allreduce_ms(0.0, load.dp_inter)))
        if load.dp_intra or load.dp_inter
        else (0.0, 0.0)
        for load in loads
    ]
    return np.column_stack([lookup.sum(axis=1), (intra + inter).sum(axis=1), np.array(dp)])


def _candidates(
    cost: CostModel, name: str, cluster: str, precision: WirePrecision, min_cuts: tuple[int, int]
) -> list[TableLayout]:
    """Layouts whose least cost no layout of the table in this cluster beats: the fewest slices, and the
    grids its kind names (ClusterKind.bound_grids), every cell on rank 0."""
    kind = cluster_kind(cluster)
    if kind.replicated:
        return [TableLayout(cluster, precision=precision)]
    t = cost.table(name)
    n_r, n_c = min_cuts
    quads = t.dim // 4
    cols = tuple(4 * round(i * quads / n_c) for i in range(n_c + 1))
    out = []
    for rows_n, hierarchical in kind.bound_grids(n_r):
        if rows_n > t.rows:
            continue
        rows = tuple(round(i * t.rows / rows_n) for i in range(rows_n + 1))
        out.append(TableLayout(cluster, rows, cols, ((0,) * n_c,) * rows_n, precision, hierarchical))
    return out


def step_lower_bound(
    cost: CostModel,
    constraints: Mapping[str, TableConstraints] | None = None,
    precision: Mapping[str, WirePrecision] | None = None,
    progress: Progress | None = None,
) -> float:
    """A step time no plan of the model on this topology beats under `cost` (see the module
    docstring); `precision`: the wire precision per cluster, where a table's constraints give none;
    `progress` hears the tables priced (stage "lower bound")."""
    constraints = constraints or {}
    precision = precision or {}
    hw = cost.topology.hardware
    w = cost.topology.world_size
    lookup_div = min(w, hw.host_cores) if hw.host_cores else w
    options: list[np.ndarray] = []  # per table: [option, (lookup ms, traffic ms, DP intra ms, DP inter ms)]
    fixed_groups: set[ShardingGroup] = set()
    least_group = 0.0  # the cheapest group some table must join
    for i, t in enumerate(cost.spec.tables):
        if progress is not None:
            progress("lower bound", i, len(cost.spec.tables), "")
        c = constraints.get(t.name, _FREE)
        if c.layout is not None:
            layouts = [c.layout]
            fixed_groups.update(cost.table_load(t.name, c.layout).groups)
        else:
            layouts = []
            for cluster in allowed_clusters(c):
                wire = c.precision or precision.get(cluster, WirePrecision())
                layouts += _candidates(cost, t.name, cluster, wire, c.min_cuts)
        parts = _parts_ms(cost, [cost.table_load(t.name, layout) for layout in layouts])
        options.append(parts / np.array([lookup_div, w, 1.0, 1.0]))
        least_group = max(least_group, _least_group_ms(cost, allowed_clusters(c)))
    collectives = max(sum(cost.group_ms(g) for g in fixed_groups), least_group)
    idle = cost.step_cost(RankLoad.zeros(w))  # no table: the dense part alone
    dense_compute = cost.dense_compute_ms
    dense_allreduce = idle.dense_ms - dense_compute
    # DDP's all-reduces hide behind the backward's share `hidden` of the compute, up to their length
    # (StepCost.overlap_ms), so a step is at least its compute with nothing of the all-reduces ...
    compute_only = sum(float(o[:, :2].sum(axis=1).min()) for o in options) + dense_compute
    # ... and at least the all-reduces in full with the compute less its backward share; the DP all-reduce of
    # the whole plan, a max (or a sum) of its intra- and inter-node times, is at least any mix m x intra +
    # (1 - m) x inter of them, which adds up table by table: the best of a few mixes
    hidden = BACKWARD_COMPUTE_MULTIPLIER / (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
    with_allreduce = 0.0
    for mix in _DP_MIXES:
        weights = np.array([1.0 - hidden, 1.0, mix, 1.0 - mix])
        tables = sum(float((o @ weights).min()) for o in options)
        with_allreduce = max(with_allreduce, tables + (1.0 - hidden) * dense_compute + dense_allreduce)
    return max(compute_only, with_allreduce) + collectives


def _least_group_ms(cost: CostModel, clusters: tuple[str, ...]) -> float:
    """The fewest collectives a group of a table in these clusters issues, priced."""
    return min(cluster_kind(k).fewest_collectives() for k in clusters) * cost.topology.collective_us / 1e3
