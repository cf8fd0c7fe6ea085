"""The plan under search, as one object every phase of the search reads and changes.

SearchState holds what the phases share (after TorchRec's planner, where proposers and partitioners
are strategies over one set of sharding options): the cost model, each table's constraints,
cluster, wire precision and allowed ranks, the memory cap and the data-parallel memory budget; and
the plan itself: every table's layout, its load (RankLoad, computed when first asked for), the
plan's per-rank total, the tables with a cell on each rank, and the DP memory used. A change is
priced by `evaluate` (the changed tables' loads swapped into the total, every constraint checked)
and taken by `apply`; `snapshot` and `restore` keep and bring back a whole plan.

The phases (phases.py: split rounds, then polishing; improve.py: the exact hill climb) are
strategies over one state with a `run(state)`; the moves they try come from one generator
(moves.py), so that a move is checked the same way in every phase.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Protocol

import numpy as np

from ..layout.kinds import cluster_kind
from ..layout.constraints import TableConstraints
from ..cost.model import CostModel, StepCost
from ..cost.load import RankLoad
from ..layout.tables import TableLayout, WirePrecision
from ..cost.objective import Objective, better, objective
from .config import SearchConfig

_FREE = TableConstraints()
Changes = list[tuple[str, TableLayout]]


@dataclass(frozen=True)
class Move:
    """New layouts (and loads) for one or more tables, the plan's total with them, its step and objective."""

    objective: Objective
    changes: tuple[tuple[str, TableLayout, RankLoad], ...]
    total: RankLoad
    step: StepCost


@dataclass(frozen=True)
class Snapshot:
    """A plan to come back to: every layout and load, the total and the DP memory used."""

    layouts: dict[str, TableLayout]
    loads: dict[str, RankLoad]
    total: RankLoad
    dp_used: float


class Phase(Protocol):
    """One strategy of the search: it reads the state and leaves a plan in it."""

    def run(self, state: "SearchState") -> None: ...


class SearchState:
    """One model, topology and cluster assignment under search (the improvement phase may re-cluster).

    `movable`: the model-parallel tables without a fixed layout, which the split rounds place;
    `names`: the tables whose layout any phase may change (the movable ones, and the data-parallel
    ones whose cluster no constraint forced), in that order, which is also the order ties are broken in."""

    def __init__(
        self,
        cost: CostModel,
        clusters: Mapping[str, str],
        constraints: Mapping[str, TableConstraints],
        config: "SearchConfig",
    ) -> None:
        self.cost = cost
        self.config = config
        self.clusters = dict(clusters)
        self.world_size = cost.topology.world_size
        self.local_world_size = cost.topology.local_world_size
        self.cap = cost.topology.hbm_cap_bytes
        self.constraints = {t.name: constraints.get(t.name, _FREE) for t in cost.spec.tables}
        self.fixed: dict[str, TableLayout] = {}
        self.movable: list[str] = []
        for t in cost.spec.tables:
            c = self.constraints[t.name]
            if c.layout is not None:
                self.fixed[t.name] = c.layout
            elif cluster_kind(self.clusters[t.name]).replicated:
                self.fixed[t.name] = TableLayout(
                    self.clusters[t.name], precision=self.precision(t.name, self.clusters[t.name])
                )
            else:
                self.movable.append(t.name)
        free_dp = [n for n in self.fixed if self.constraints[n].layout is None and self.constraints[n].cluster is None]
        self.names = self.movable + free_dp
        self.order = {n: i for i, n in enumerate(self.names)}
        # shared by the tables every rank is allowed for: 50,000 tables need no 50,000 rank lists
        everyone = np.arange(self.world_size)
        self.allowed: dict[str, np.ndarray] = {}
        self.allowed_set: dict[str, set[int] | None] = {}  # None: every rank
        for n in self.names:
            ranks = self.constraints[n].ranks
            self.allowed[n] = everyone if ranks is None else np.array(sorted(set(ranks)), dtype=np.int64)
            self.allowed_set[n] = None if ranks is None else set(ranks)
        self._hier_cache: dict[TableLayout, bool] = {}
        fixed_loads = [cost.table_load(name, layout) for name, layout in self.fixed.items()]
        self.fixed_memory = np.zeros(self.world_size)
        for load in fixed_loads:
            self.fixed_memory += load.memory
        self.fixed_total = RankLoad.total(fixed_loads, self.world_size)
        self.dp_budget = config.dp_memory_fraction * self.cap
        self.priced = 0  # candidates evaluate() priced, in every phase
        # the plan: set by set_plan, changed by apply
        self.layouts: dict[str, TableLayout] = {}
        self.loads: dict[str, RankLoad] = {}
        self.total = RankLoad.zeros(self.world_size)
        self.holders: dict[int, set[str]] = {k: set() for k in range(self.world_size)}
        self.dp_used = 0.0

    # ---- the tables --------------------------------------------------------------------------

    def precision(self, name: str, cluster: str) -> WirePrecision:
        """The table's wire precision in a cluster: its own, else the cluster's (SearchConfig.precision)."""
        return self.constraints[name].precision or self.config.precision.get(cluster, WirePrecision())

    def dp_weights(self, name: str) -> float:
        """A DP copy's bytes on every rank: what the DP memory budget counts."""
        t = self.cost.table(name)
        return t.rows * self.cost.row_memory(name, t.dim)

    def hierarchy(self, name: str, layout: TableLayout) -> TableLayout:
        """Row-split RB tables reduce inside the node first when that lowers the table's own
        communication bottleneck, counting the extra collectives of the two-stage reduction."""
        if len(layout.kind.hierarchy_options(layout.num_row_slices)) < 2:
            return layout
        if layout not in self._hier_cache:
            flat, hier = (replace(layout, hierarchical=h) for h in (False, True))
            steps = [self.cost.step_cost(self.cost.table_load(name, v)) for v in (flat, hier)]
            ms = [step.comm_ms + step.collective_ms for step in steps]
            self._hier_cache[layout] = ms[1] < ms[0]
        return replace(layout, hierarchical=self._hier_cache[layout])

    # ---- the plan ----------------------------------------------------------------------------

    def set_plan(self, layouts: dict[str, TableLayout], total: RankLoad) -> None:
        """Starts from this plan (every table's layout, and their total load as the cost model adds it)."""
        self.layouts = layouts
        self.total = total
        self.loads = {}
        self.holders = {k: set() for k in range(self.world_size)}
        for name in self.names:
            self.hold(name, layouts[name], True)
        self.dp_used = sum(self.dp_weights(n) for n, layout in layouts.items() if layout.kind.replicated)

    def load(self, name: str) -> RankLoad:
        """The table's load in its current layout (the cost model's, not to be modified)."""
        load = self.loads.get(name)
        if load is None:
            load = self.loads[name] = self.cost.table_load(name, self.layouts[name])
        return load

    def hold(self, name: str, layout: TableLayout, holds: bool) -> None:
        """Records (or forgets) the ranks the table has cells on: a bottleneck rank's tables are looked up there."""
        if not layout.kind.replicated:
            for k in layout.used_ranks():
                (self.holders[k].add if holds else self.holders[k].discard)(name)

    def evaluate(self, changes: Changes, decide_hierarchy: bool = True) -> Move | None:
        """The plan with these tables' layouts changed (row-split RB ones as hierarchy() reduces them,
        unless `decide_hierarchy` is False: then as their layouts say); None when a rank's memory, the
        one column width per table on a rank or the DP memory budget would be broken."""
        if any(not layout.kind.replicated and layout.mixed_width_rank() is not None for _, layout in changes):
            return None
        total = self.total.copy()
        out = []
        dp_used = self.dp_used
        for name, layout in changes:
            if decide_hierarchy:
                layout = self.hierarchy(name, layout)
            dp_used += self.dp_weights(name) * (layout.kind.replicated - self.layouts[name].kind.replicated)
            new = self.cost.table_load(name, layout)
            total.add(self.load(name), -1.0)
            total.add(new)
            out.append((name, layout, new))
        if dp_used > max(self.dp_budget, self.dp_used) or total.memory.max() > self.cap:
            return None
        self.priced += 1
        step = self.cost.step_cost(total)
        return Move(objective(step), tuple(out), total, step)

    def apply(self, move: Move) -> None:
        for name, layout, load in move.changes:
            old = self.layouts[name]
            self.dp_used += self.dp_weights(name) * (layout.kind.replicated - old.kind.replicated)
            self.hold(name, old, False)
            self.hold(name, layout, True)
            self.layouts[name] = layout
            self.loads[name] = load
        self.total = move.total

    def snapshot(self) -> Snapshot:
        return Snapshot(dict(self.layouts), dict(self.loads), self.total, self.dp_used)

    def restore(self, snapshot: Snapshot) -> None:
        for name in self.names:
            layout = snapshot.layouts[name]
            if self.layouts[name] is not layout:
                self.hold(name, self.layouts[name], False)
                self.hold(name, layout, True)
                self.layouts[name] = layout
        self.loads, self.total, self.dp_used = dict(snapshot.loads), snapshot.total, snapshot.dp_used


def better_move(a: Move | None, b: Move | None) -> Move | None:
    """The better of two moves, either of which may be missing; a on a tie (the first priced wins)."""
    if a is None:
        return b
    return b if b is not None and better(b.objective, a.objective) else a
