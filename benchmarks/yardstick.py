"""A yardstick for the planner: simulated annealing over whole plans, independent of its greedy search.

The planner's greedy cuts tables by doubling, places cells by an estimate and climbs from there, so a
longer run of the same search measures little of what it misses. This search shares only the cost
model (CostModel.table_load and step_cost price every candidate exactly) and the layout's rules; it
anneals from several seeds (the planner's own plan, TWRW, TorchRec's default plan where there is one,
a random plan) with moves the greedy does not make in one step:

- recut: the whole table re-cut into any number of row slices (1 up to a full node or the whole
  cluster) and column slices, its cells confined to 1..N nodes (the least loaded ones, the ones it
  uses, or random ones) on their least loaded ranks, flat and hierarchical both priced;
- confine: the same grid on fewer nodes;
- move / swap: a cell of a busy rank to another rank, or swapped with another table's cell there;
- cluster: DP, RB or UB, keeping the grid where there is one;
- group: many tables of one sharding group at once (all, the heaviest or a random few) turned UB,
  RB, DP, hierarchical or flat, or split in two or merged whole: a group costs its collectives
  until its last table leaves it, and a new one pays only when enough tables join it.

Candidates are the tables that load the busiest ranks (by lookups, by communication) most, and some
random ones. Acceptance is Metropolis on step_ms + ENERGY_WEIGHT x (mean of the top ranks' lookups +
mean of the top ranks' communication), so that a move which only lowers the second busiest rank
still counts; the best plan is the one with the lowest step (ties: objective.better). Every plan it
keeps fits each rank's memory, tiles every table (TableLayout.validate), keeps one width per table on
a rank, keeps each table on its allowed ranks, clusters and cuts (TableConstraints), and keeps the
data-parallel tables within dp_memory_fraction of a rank's memory (the planner's rule, clusters.py;
or within the seed's, where a seed has more). Its budget is priced candidates, not seconds, and its
random choices come from one seeded generator: the result is a function of the seed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from embark_torchrec.plan.search.balance import comm_imbalance
from embark_torchrec.plan.cost.bound import allowed_clusters
from embark_torchrec.plan.layout.constraints import TableConstraints
from embark_torchrec.plan.cost.model import CostModel, StepCost
from embark_torchrec.plan.cost.load import RankLoad
from embark_torchrec.plan.layout.groups import ShardingGroup
from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.cost.objective import Objective, better, objective

_FREE = TableConstraints()
ENERGY_WEIGHT = 0.25
TOP_RANKS = 4  # the ranks whose mean load the energy adds
SEED_SHARE = 0.3  # of the budget, shared among the seeds; the rest anneals the best plan they gave
Changes = list[tuple[str, TableLayout]]


@dataclass(frozen=True)
class YardstickConfig:
    evaluations: int = 20000  # priced candidates in all (the budget)
    seconds: float | None = None  # also stop after this long (then the result depends on the machine)
    seed: int = 0
    dp_memory_fraction: float = 0.05  # as SearchConfig's: the DP tables' share of a rank's memory
    start_temperature: float = 0.01  # of the seed's step: a move 1% worse is taken with probability 1/e
    end_temperature: float = 1e-4
    random_seeds: int = 1  # random plans among the seeds
    precision: Mapping[str, WirePrecision] = field(default_factory=dict)  # per cluster; default fp32


@dataclass(frozen=True)
class SeedResult:
    name: str
    start_ms: float | None  # None: the seed was not a valid plan (reason says why)
    end_ms: float | None
    reason: str = ""


@dataclass(frozen=True)
class YardstickResult:
    plan: Plan
    step: StepCost
    seeds: tuple[SeedResult, ...]
    evaluations: int
    accepted: Mapping[str, int]  # accepted moves by kind
    improved: Mapping[str, int]  # moves by kind that gave a new best plan
    seconds: float


@dataclass
class _State:
    layouts: dict[str, TableLayout]
    loads: dict[str, RankLoad]
    total: RankLoad
    step: StepCost
    energy: float
    objective: Objective
    dp_used: float
    dp_budget: float
    holders: list[dict[str, None]]  # per rank, the model-parallel free tables with a cell there (ordered)


@dataclass(frozen=True)
class _Candidate:
    changes: tuple[tuple[str, TableLayout, RankLoad], ...]
    total: RankLoad
    step: StepCost
    energy: float
    objective: Objective
    dp_used: float


def _snapshot(state: _State) -> _State:
    """A copy that later moves on `state` leave alone (the loads and totals are never written to)."""
    return replace(
        state, layouts=dict(state.layouts), loads=dict(state.loads), holders=[dict(h) for h in state.holders]
    )


def energy(step: StepCost) -> float:
    """What the annealing minimises: the step, plus a little of the top ranks' lookups and traffic."""
    k = min(TOP_RANKS, len(step.rank_lookup_ms))
    comm = step.rank_intra_ms + step.rank_inter_ms
    top = np.partition(step.rank_lookup_ms, -k)[-k:].mean() + np.partition(comm, -k)[-k:].mean()
    return step.step_ms + ENERGY_WEIGHT * float(top)


class Yardstick:
    """Simulated annealing over plans of one model on one topology, priced by `cost`."""

    def __init__(
        self,
        cost: CostModel,
        config: YardstickConfig | None = None,
        constraints: Mapping[str, TableConstraints] | None = None,
    ) -> None:
        self.cost = cost
        self.config = config or YardstickConfig()
        self.spec = cost.spec
        topo = cost.topology
        self.world_size, self.lws, self.num_nodes = topo.world_size, topo.local_world_size, topo.num_nodes
        self.cap = topo.hbm_cap_bytes
        self.rng = np.random.default_rng(self.config.seed)
        constraints = constraints or {}
        self.con = {t.name: constraints.get(t.name, _FREE) for t in self.spec.tables}
        self.names = [t.name for t in self.spec.tables]
        self.free = [n for n in self.names if self.con[n].layout is None]  # tables whose layout may change
        everyone = np.arange(self.world_size)
        self.allowed = {
            n: everyone if self.con[n].ranks is None else np.array(sorted(set(self.con[n].ranks))) for n in self.names
        }
        self.clusters = {n: allowed_clusters(self.con[n]) for n in self.names}
        self.evaluations = 0
        self.accepted: dict[str, int] = {}
        self.improved: dict[str, int] = {}
        self._deadline = math.inf
        self._moves: tuple[tuple[str, float, Callable[[_State, str], list[Changes]]], ...] = (
            ("recut", 0.30, self._recut),
            ("confine", 0.08, self._confine),
            ("move", 0.20, self._move),
            ("swap", 0.15, self._swap),
            ("cluster", 0.12, self._recluster),
            ("group", 0.10, self._group),
            ("hierarchy", 0.05, self._toggle_hierarchy),
        )

    # ---- rules -----------------------------------------------------------------------------------

    def _precision(self, name: str, cluster: str) -> WirePrecision:
        return self.con[name].precision or self.config.precision.get(cluster, WirePrecision())

    def _dp_bytes(self, name: str) -> float:
        t = self.cost.table(name)
        return t.rows * self.cost.row_memory(name, t.dim)

    def allows(self, name: str, layout: TableLayout) -> str | None:
        """Why the table may not take this layout under its constraints and the grid's rules, or None."""
        con, t = self.con[name], self.cost.table(name)
        if con.layout is not None:
            return None if layout == con.layout else "its layout is fixed"
        if layout.cluster not in self.clusters[name]:
            return f"cluster {layout.cluster} is not allowed"
        if layout.cluster == "dp":
            return None
        try:
            layout.validate(name, t.rows, t.dim, self.world_size)
        except PlanError as e:
            return str(e)
        n_r, n_c = layout.num_row_slices, layout.num_col_slices
        if n_r < con.min_cuts[0] or n_c < con.min_cuts[1]:
            return f"fewer than {con.min_cuts} slices"
        if (n_r > 1 and not con.row_cuts) or (n_c > 1 and not con.column_cuts) or (n_r > 1 < n_c and not con.grid_cuts):
            return "cuts not allowed"
        if min(np.diff(layout.col_bounds)) < con.min_column_width:
            return f"columns narrower than {con.min_column_width}"
        if con.ranks is not None and not layout.used_ranks() <= set(con.ranks):
            return "ranks not allowed"
        return None

    # ---- states and pricing ------------------------------------------------------------------------

    def _state(self, layouts: Mapping[str, TableLayout], dp_floor: float = 0.0) -> _State:
        layouts = {n: layouts[n] for n in self.names}
        loads = {n: self.cost.table_load(n, layouts[n]) for n in self.names}
        total = RankLoad.total(loads.values(), self.world_size)
        step = self.cost.step_cost(total)
        dp_used = sum(self._dp_bytes(n) for n in self.names if layouts[n].cluster == "dp")
        budget = max(self.config.dp_memory_fraction * self.cap, dp_used, dp_floor)
        holders: list[dict[str, None]] = [{} for _ in range(self.world_size)]
        for n in self.free:
            for k in sorted(layouts[n].used_ranks()) if layouts[n].cluster != "dp" else ():
                holders[k][n] = None
        return _State(layouts, loads, total, step, energy(step), objective(step), dp_used, budget, holders)

    def _price(self, state: _State, changes: Changes) -> _Candidate | None:
        """The plan with these layouts; None when a rule, a rank's memory or the DP budget is broken."""
        total = state.total.copy()
        dp_used = state.dp_used
        out = []
        for name, layout in changes:
            if self.allows(name, layout) is not None:
                return None
            old = state.layouts[name]
            dp_used += self._dp_bytes(name) * ((layout.cluster == "dp") - (old.cluster == "dp"))
            new = self.cost.table_load(name, layout)
            total.add(state.loads[name], -1.0)
            total.add(new)
            out.append((name, layout, new))
        if dp_used > state.dp_budget or total.memory.max() > self.cap:
            return None
        self.evaluations += 1
        step = self.cost.step_cost(total)
        return _Candidate(tuple(out), total, step, energy(step), objective(step), dp_used)

    @staticmethod
    def _apply(state: _State, c: _Candidate) -> None:
        for name, layout, load in c.changes:
            old = state.layouts[name]
            for k in old.used_ranks() if old.cluster != "dp" else ():
                state.holders[k].pop(name, None)
            for k in sorted(layout.used_ranks()) if layout.cluster != "dp" else ():
                state.holders[k][name] = None
            state.layouts[name], state.loads[name] = layout, load
        state.total, state.step, state.energy, state.objective, state.dp_used = (
            c.total,
            c.step,
            c.energy,
            c.objective,
            c.dp_used,
        )

    # ---- choices ---------------------------------------------------------------------------------

    def _pick(self, seq: Sequence) -> object:
        return seq[int(self.rng.integers(len(seq)))]

    def _busy_rank(self, state: _State) -> int:
        """The busiest rank by lookups, by communication or by both (sometimes one of the top few)."""
        s = state.step
        measure = self._pick((s.rank_lookup_ms, s.rank_intra_ms + s.rank_inter_ms, s.rank_load_ms))
        order = np.argsort(-measure, kind="stable")
        return int(order[0] if self.rng.random() < 0.7 else order[int(self.rng.integers(min(4, len(order))))])

    def _table(self, state: _State) -> str | None:
        """A table that loads a busy rank most (weighted by its load there), or a random free one."""
        if not self.free:
            return None
        if self.rng.random() < 0.75:
            k = self._busy_rank(state)
            names = list(state.holders[k])
            if names:
                ms = self.cost.rank_load_ms(np.stack([state.loads[n].rows[:, k] for n in names], axis=1))
                ms = np.maximum(ms, 0.0) + 1e-12
                return names[int(self.rng.choice(len(names), p=ms / ms.sum()))]
        return str(self._pick(self.free))

    def _base_ms(self, state: _State, names: Sequence[str]) -> np.ndarray:
        """Each rank's load (lookups + communication) without these tables."""
        rows = state.total.rows.copy()
        for n in names:
            rows -= state.loads[n].rows
        return self.cost.rank_load_ms(rows)

    def _nodes(self, state: _State, name: str, count: int, base: np.ndarray) -> list[int]:
        """`count` nodes with allowed ranks: the least loaded, the ones the table uses most, or random."""
        ranks = self.allowed[name]
        nodes = sorted(set((ranks // self.lws).tolist()))
        count = min(count, len(nodes))
        u = self.rng.random()
        if u < 0.5:
            node_ms = {n: float(base[ranks[ranks // self.lws == n]].mean()) for n in nodes}
            return sorted(nodes, key=lambda n: (node_ms[n], n))[:count]
        layout = state.layouts[name]
        if u < 0.75 and layout.cluster != "dp":
            used: dict[int, int] = {}
            for row in layout.ranks:
                for k in row:
                    used[k // self.lws] = used.get(k // self.lws, 0) + 1
            ordered = sorted(nodes, key=lambda n: (-used.get(n, 0), n))
            return ordered[:count]
        return sorted(self.rng.choice(nodes, size=count, replace=False).tolist())

    def _grid(self, name: str, cluster: str, n_r: int, n_c: int) -> TableLayout:
        t = self.cost.table(name)
        rows = tuple(round(i * t.rows / n_r) for i in range(n_r + 1))
        quads = t.dim // 4
        cols = tuple(4 * round(i * quads / n_c) for i in range(n_c + 1))
        return TableLayout(cluster, rows, cols, ((0,) * n_c,) * n_r, self._precision(name, cluster))

    def _placed(
        self, state: _State, name: str, grid: TableLayout, nodes: list[int] | None, base: np.ndarray
    ) -> TableLayout:
        """The grid's cells on the allowed ranks of `nodes` (all when None), least loaded first (or in a
        random order, sometimes), one cell per rank while there are ranks enough."""
        ranks = self.allowed[name]
        if nodes is not None:
            ranks = ranks[np.isin(ranks // self.lws, nodes)]
        if self.rng.random() < 0.8:
            order = ranks[np.lexsort((ranks, base[ranks]))]
        else:
            order = self.rng.permutation(ranks)
        cells = grid.num_row_slices * grid.num_col_slices
        chosen = [int(order[i % len(order)]) for i in range(cells)]
        n_c = grid.num_col_slices
        return grid.with_ranks(tuple(tuple(chosen[r * n_c : (r + 1) * n_c]) for r in range(grid.num_row_slices)))

    def _variants(self, layout: TableLayout) -> list[TableLayout]:
        """A row-split RB layout both flat and hierarchical; any other as it is."""
        if layout.cluster != "rb" or layout.num_row_slices < 2:
            return [replace(layout, hierarchical=False)]
        return [replace(layout, hierarchical=False), replace(layout, hierarchical=True)]

    def _shape(self, name: str, current: tuple[int, int]) -> tuple[int, int]:
        """A grid shape the table's constraints allow: row slices near the current count, a multiple of
        a node, or any count up to the cluster (log-uniform); column slices mostly kept."""
        con, t = self.con[name], self.cost.table(name)
        room = len(self.allowed[name])
        max_c = t.dim // con.min_column_width if con.column_cuts else 1
        n_c = current[1]
        if self.rng.random() < 0.25 and max_c > 1:
            n_c = int(self._pick([c for c in (1, 2, 3, 4, 8, n_c - 1, n_c + 1, 2 * n_c) if 1 <= c <= max_c]))
        n_c = max(n_c, con.min_cuts[1])
        max_r = min(t.rows, room // n_c) if con.row_cuts and (n_c == 1 or con.grid_cuts) else 1
        n_r, u = current[0], self.rng.random()
        if u < 0.3:
            n_r = int(self._pick((n_r - 1, n_r + 1, 2 * n_r, n_r // 2, n_r + self.lws, n_r - self.lws)))
        elif u < 0.55:
            n_r = self.lws * int(self.rng.integers(1, self.num_nodes + 1))
        else:
            n_r = int(round(math.exp(self.rng.uniform(0.0, math.log(max(max_r, 1)) + 1e-9))))
        return max(con.min_cuts[0], min(max(n_r, 1), max(max_r, 1))), n_c

    # ---- moves: each returns alternatives (lists of changes), of which the cheapest is proposed ----

    def _recut(self, state: _State, name: str) -> list[Changes]:
        layout = state.layouts[name]
        model_parallel = [c for c in self.clusters[name] if c != "dp"]
        if not model_parallel:
            return []
        if layout.cluster == "dp" or self.rng.random() < 0.1:
            cluster = str(self._pick(model_parallel))
            current = self.con[name].min_cuts
        else:
            cluster = layout.cluster
            current = (layout.num_row_slices, layout.num_col_slices)
        n_r, n_c = self._shape(name, current)
        base = self._base_ms(state, [name])
        need = -(-n_r * n_c // self.lws)
        count = need + int(self.rng.integers(0, 3)) if self.rng.random() < 0.8 else int(self.rng.integers(1, need + 1))
        nodes = None if count >= self.num_nodes else self._nodes(state, name, count, base)
        placed = self._placed(state, name, self._grid(name, cluster, n_r, n_c), nodes, base)
        return [[(name, v)] for v in self._variants(placed)]

    def _confine(self, state: _State, name: str) -> list[Changes]:
        layout = state.layouts[name]
        if layout.cluster == "dp":
            return []
        used = sorted({k // self.lws for k in layout.used_ranks()})
        if len(used) < 2:
            return []
        count = int(self.rng.integers(1, len(used)))
        base = self._base_ms(state, [name])
        placed = self._placed(state, name, layout, self._nodes(state, name, count, base), base)
        return [[(name, v)] for v in self._variants(placed)]

    def _cell_on(self, layout: TableLayout, rank: int | None) -> tuple[int, int]:
        cells = [(r, c) for r, row in enumerate(layout.ranks) for c, k in enumerate(row) if rank is None or k == rank]
        return cells[int(self.rng.integers(len(cells)))] if cells else (0, 0)

    def _target(self, state: _State, name: str, exclude: int) -> int:
        """A rank to move a cell to: one of the least loaded allowed ones, or a random one."""
        ranks = self.allowed[name]
        ranks = ranks[ranks != exclude]
        if not len(ranks):
            return exclude
        if self.rng.random() < 0.2:
            return int(self._pick(ranks))
        s = state.step
        measure = self._pick((s.rank_lookup_ms, s.rank_intra_ms + s.rank_inter_ms, s.rank_load_ms))
        order = ranks[np.lexsort((ranks, measure[ranks]))]
        return int(order[int(self.rng.integers(min(4, len(order))))])

    def _moved_cell(self, state: _State, name: str) -> tuple[TableLayout, int, int, int, int] | None:
        """A cell of the table (one on a busy rank when it has one), where it is and a rank to move it to:
        (layout, row, column, its rank, target rank); None for a data-parallel table."""
        layout = state.layouts[name]
        if layout.cluster == "dp":
            return None
        k = self._busy_rank(state)
        r, c = self._cell_on(layout, k if k in layout.used_ranks() else None)
        src = layout.ranks[r][c]
        return layout, r, c, src, self._target(state, name, src)

    def _move(self, state: _State, name: str) -> list[Changes]:
        moved = self._moved_cell(state, name)
        if moved is None:
            return []
        layout, r, c, _, q = moved
        grid = [list(row) for row in layout.ranks]
        grid[r][c] = q
        return [[(name, layout.with_ranks(tuple(map(tuple, grid))))]]

    def _swap(self, state: _State, name: str) -> list[Changes]:
        moved = self._moved_cell(state, name)
        if moved is None:
            return []
        layout, r, c, src, q = moved
        others = [n for n in state.holders[q] if n != name]
        if not others:
            return []
        other = str(self._pick(others))
        o_layout = state.layouts[other]
        r2, c2 = self._cell_on(o_layout, q)
        grid = [list(row) for row in layout.ranks]
        grid[r][c] = q
        o_grid = [list(row) for row in o_layout.ranks]
        o_grid[r2][c2] = src
        return [
            [
                (name, layout.with_ranks(tuple(map(tuple, grid)))),
                (other, o_layout.with_ranks(tuple(map(tuple, o_grid)))),
            ]
        ]

    def _reclustered(self, state: _State, name: str, cluster: str, base: np.ndarray) -> TableLayout | None:
        """The table in another cluster: DP, the same grid in RB / UB, or from DP its fewest slices placed."""
        layout = state.layouts[name]
        if cluster == layout.cluster or cluster not in self.clusters[name]:
            return None
        if cluster == "dp":
            return TableLayout.data_parallel(self._precision(name, "dp"))
        if layout.cluster == "dp":
            grid = self._grid(name, cluster, *self.con[name].min_cuts)
            return self._placed(state, name, grid, None, base)
        return replace(layout, cluster=cluster, precision=self._precision(name, cluster), hierarchical=False)

    def _recluster(self, state: _State, name: str) -> list[Changes]:
        base = self._base_ms(state, [name])
        out = []
        for cluster in self.clusters[name]:
            layout = self._reclustered(state, name, cluster, base)
            if layout is not None:
                out += [[(name, v)] for v in self._variants(layout)]
        return out

    def _toggle_hierarchy(self, state: _State, name: str) -> list[Changes]:
        layout = state.layouts[name]
        if layout.cluster != "rb" or layout.num_row_slices < 2:
            return []
        return [[(name, replace(layout, hierarchical=not layout.hierarchical))]]

    def _group_of(self, state: _State, name: str) -> ShardingGroup:
        return next(iter(state.loads[name].groups))

    def _group(self, state: _State, name: str) -> list[Changes]:
        """Many tables of `name`'s sharding group at once: all of them, the heaviest few, or a random
        few, turned into one other form."""
        group = self._group_of(state, name)
        members = [n for n in self.free if self._group_of(state, n) == group]
        u = self.rng.random()
        if u < 0.4 or len(members) == 1:
            chosen = members
        else:
            m = int(self.rng.integers(1, len(members) + 1))
            if u < 0.7:
                weight = {n: float(self.cost.rank_load_ms(state.loads[n].rows).sum()) for n in members}
                chosen = sorted(members, key=lambda n: (-weight[n], n))[:m]
            else:
                chosen = [members[i] for i in sorted(self.rng.choice(len(members), size=m, replace=False).tolist())]
        base = self._base_ms(state, chosen)
        form = str(self._pick(("ub", "rb", "dp", "hier", "flat", "split", "whole")))
        changes: Changes = []
        for n in chosen:
            layout = state.layouts[n]
            new: TableLayout | None
            if form in ("ub", "rb", "dp"):
                new = self._reclustered(state, n, form, base)
            elif form in ("hier", "flat"):
                ok = layout.cluster == "rb" and layout.num_row_slices > 1
                new = replace(layout, hierarchical=form == "hier") if ok else None
            elif form == "split":
                new = self._split_in_two(state, n, base) if layout.cluster != "dp" else None
            else:
                new = self._placed(state, n, self._grid(n, layout.cluster, 1, 1), None, base)
                new = new if layout.cluster != "dp" else None
            if new is not None and new != layout:
                changes.append((n, new))
                base = base + self.cost.rank_load_ms(self.cost.table_load(n, new).rows)
        return [changes] if changes else []

    def _split_in_two(self, state: _State, name: str, base: np.ndarray) -> TableLayout | None:
        """The table's first row slice cut in half, the new half on the least loaded rank of its node."""
        layout = state.layouts[name]
        r0, r1 = layout.row_bounds[0], layout.row_bounds[1]
        if r1 - r0 < 2 or not self.con[name].row_cuts or (layout.num_col_slices > 1 and not self.con[name].grid_cuts):
            return None
        k = layout.ranks[0][0]
        ranks = self.allowed[name]
        node = ranks[(ranks // self.lws == k // self.lws) & (ranks != k)]
        if not len(node):
            return None
        q = int(node[np.lexsort((node, base[node]))][0])
        return layout.split_rows(0, (r0 + r1) // 2, (q,) * layout.num_col_slices)

    # ---- seeds -------------------------------------------------------------------------------------

    def random_plan(self) -> dict[str, TableLayout] | None:
        """Every free table in a random model-parallel cluster, cut into a random number of row slices
        (more where it would not fit) on random ranks of one node or a few; None if it never fits."""
        for _ in range(8):
            layouts: dict[str, TableLayout] = {n: self.con[n].layout for n in self.names if self.con[n].layout}
            memory = np.zeros(self.world_size)
            for n in self.names:
                if n in layouts:
                    memory += self.cost.table_load(n, layouts[n]).memory
                    continue
                clusters = [c for c in self.clusters[n] if c != "dp"] or ["dp"]
                cluster = str(self._pick(clusters))
                if cluster == "dp":
                    layouts[n] = TableLayout.data_parallel(self._precision(n, "dp"))
                    memory += self.cost.table_load(n, layouts[n]).memory
                    continue
                t = self.cost.table(n)
                fits = int(math.ceil(t.rows * self.cost.row_memory(n, t.dim) / (0.5 * self.cap)))
                n_r, n_c = self._shape(n, self.con[n].min_cuts)
                n_r = min(max(n_r, fits), t.rows, len(self.allowed[n]) // n_c)
                count = min(self.num_nodes, -(-n_r * n_c // self.lws))
                nodes = self.rng.choice(self.num_nodes, size=count, replace=False).tolist()
                variants = self._variants(self._placed_random(n, self._grid(n, cluster, n_r, n_c), nodes))
                layouts[n] = variants[int(self.rng.integers(len(variants)))]
                memory += self.cost.table_load(n, layouts[n]).memory
            if memory.max() <= self.cap:
                return layouts
        return None

    def _placed_random(self, name: str, grid: TableLayout, nodes: list[int]) -> TableLayout:
        ranks = self.allowed[name]
        local = ranks[np.isin(ranks // self.lws, nodes)]
        order = self.rng.permutation(local if len(local) else ranks)
        cells = grid.num_row_slices * grid.num_col_slices
        chosen = [int(order[i % len(order)]) for i in range(cells)]
        n_c = grid.num_col_slices
        return grid.with_ranks(tuple(tuple(chosen[r * n_c : (r + 1) * n_c]) for r in range(grid.num_row_slices)))

    def _seed_state(self, plan: Mapping[str, TableLayout]) -> tuple[_State | None, str]:
        """The seed as a state to anneal from, or None and why it cannot be one."""
        for n in self.names:
            why = "no layout" if n not in plan else self.allows(n, plan[n])
            if why is not None:
                return None, f"table {n!r}: {why}"
        state = self._state(plan)
        if state.total.memory.max() > self.cap:
            k = int(np.argmax(state.total.memory))
            return None, f"rank {k} over its memory cap"
        return state, ""

    # ---- the annealing ---------------------------------------------------------------------------

    def _spent(self, budget: int) -> bool:
        return self.evaluations >= budget or time.perf_counter() > self._deadline

    def _anneal(self, state: _State, budget: int, start_t: float, best: _State) -> _State:
        """Anneals `state` until `self.evaluations` reaches `budget`; returns the best state seen (or
        `best`, when nothing beat it)."""
        kinds = [m[0] for m in self._moves]
        weights = np.array([m[1] for m in self._moves])
        weights /= weights.sum()
        makers = {m[0]: m[2] for m in self._moves}
        first = self.evaluations
        span = max(budget - first, 1)
        scale = state.step.step_ms
        stale_limit = max(span // 8, 200)
        last_best = self.evaluations
        while not self._spent(budget):
            frac = (self.evaluations - first) / span
            temp = scale * start_t * (self.config.end_temperature / start_t) ** frac
            name = self._table(state)
            if name is None:
                break
            kind = kinds[int(self.rng.choice(len(kinds), p=weights))]
            options = [c for ch in makers[kind](state, name) if ch and (c := self._price(state, ch)) is not None]
            if not options:
                self.evaluations += 1  # a proposal that priced nothing still spends budget
                continue
            cand = min(options, key=lambda c: c.energy)
            delta = cand.energy - state.energy
            if delta <= 0 or self.rng.random() < math.exp(-delta / max(temp, 1e-15)):
                self._apply(state, cand)
                self.accepted[kind] = self.accepted.get(kind, 0) + 1
                if better(state.objective, best.objective):
                    best = _snapshot(state)
                    self.improved[kind] = self.improved.get(kind, 0) + 1
                    last_best = self.evaluations
            if self.evaluations - last_best > stale_limit:  # restart from the best plan seen
                state = self._state(best.layouts, best.dp_budget)
                last_best = self.evaluations
        return best

    def run(self, seeds: Mapping[str, Plan | Mapping[str, TableLayout] | None]) -> YardstickResult:
        """Anneals from each valid seed (SEED_SHARE of the budget shared among them), then from the best
        plan found (the rest, cooler); returns the best plan, never worse than the best seed."""
        start = time.perf_counter()
        if self.config.seconds is not None:
            self._deadline = start + self.config.seconds
        named: list[tuple[str, Mapping[str, TableLayout] | None]] = [
            (n, p.tables if isinstance(p, Plan) else p) for n, p in seeds.items()
        ]
        for i in range(self.config.random_seeds):
            named.append((f"random{i}" if self.config.random_seeds > 1 else "random", self.random_plan()))
        states: list[tuple[str, _State]] = []
        results: dict[str, SeedResult] = {}
        for name, layouts in named:
            state, why = self._seed_state(layouts) if layouts is not None else (None, "no plan")
            if state is None:
                results[name] = SeedResult(name, None, None, why)
            else:
                states.append((name, state))
        if not states:
            raise PlanError("the yardstick has no valid seed: " + "; ".join(r.reason for r in results.values()))
        budget = self.config.evaluations
        share = int(budget * SEED_SHARE) // len(states)
        ends: list[tuple[str, _State]] = []
        for name, state in states:
            start_ms = state.step.step_ms
            end = self._anneal(
                state, min(budget, self.evaluations + share), self.config.start_temperature, _snapshot(state)
            )
            results[name] = SeedResult(name, start_ms, end.step.step_ms)
            ends.append((name, end))
        best = ends[0][1]
        for _, end in ends[1:]:
            if better(end.objective, best.objective):
                best = end
        final = self._anneal(self._state(best.layouts, best.dp_budget), budget, self.config.start_temperature / 4, best)
        topo = self.cost.topology
        plan = Plan(topo.world_size, topo.local_world_size, dict(final.layouts)).with_kinds(self.spec)
        step = self.cost.evaluate(plan)
        plan.validate(self.spec, step.rank_memory, self.cap)
        order = [n for n, _ in named]
        return YardstickResult(
            plan,
            step,
            tuple(results[n] for n in order),
            self.evaluations,
            dict(self.accepted),
            dict(self.improved),
            time.perf_counter() - start,
        )


# ---- describing where two plans differ (for the report) ------------------------------------------


def _spans(values: Sequence[int]) -> str:
    """1,2,3,7 -> "1-3,7"."""
    out: list[str] = []
    for v in sorted(set(values)):
        if out and v == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


def layout_summary(layout: TableLayout, local_world_size: int) -> str:
    """e.g. "rb 16x1 hier on nodes 0-1 (ranks 0-15)", "dp"."""
    if layout.cluster == "dp":
        return "dp"
    ranks = sorted(layout.used_ranks())
    nodes = _spans([k // local_world_size for k in ranks])
    hier = " hier" if layout.hierarchical else ""
    grid = f"{layout.cluster} {layout.num_row_slices}x{layout.num_col_slices}{hier}"
    return f"{grid} on nodes {nodes} (ranks {_spans(ranks)})"


def _groups(load: RankLoad) -> str:
    used = sorted((g.module, g.name, n) for g, n in load.groups.items() if n > 0)
    return ", ".join(f"{module} {name} {n}" for module, name, n in used)


def plan_differences(cost: CostModel, a: Plan, b: Plan, top: int = 6) -> list[str]:
    """Where plan b differs from plan a: the step's parts, the sharding groups (tables in each), and
    the `top` tables whose layouts differ, by the most either plan's layout of them loads one rank."""
    sa, sb = cost.evaluate(a), cost.evaluate(b)
    parts = ", ".join(f"{k.removesuffix('_ms')} {sa.parts()[k]:.3f} -> {sb.parts()[k]:.3f}" for k in sa.parts())
    lines = [f"ms {parts}; comm max/avg {comm_imbalance(sa):.2f} -> {comm_imbalance(sb):.2f}"]
    load_a, load_b = cost.rank_load(a), cost.rank_load(b)
    if load_a.groups != load_b.groups:
        lines.append(f"groups (tables): {_groups(load_a)} -> {_groups(load_b)}")
    lws = cost.topology.local_world_size
    changed, permuted = [], 0
    for name, layout in a.tables.items():
        other = b.tables[name]
        if layout == other:
            continue
        if layout_summary(layout, lws) == layout_summary(other, lws):
            permuted += 1
            continue
        peak = max(float(cost.rank_load_ms(cost.table_load(name, x).rows).max()) for x in (layout, other))
        changed.append((-peak, name, layout, other))
    changed.sort(key=lambda c: (c[0], c[1]))
    for neg, name, layout, other in changed[:top]:
        lines.append(
            f"{name} (up to {-neg:.3f} ms on a rank): {layout_summary(layout, lws)} -> {layout_summary(other, lws)}"
        )
    if len(changed) > top:
        lines.append(f"... and {len(changed) - top} more tables laid out differently")
    if permuted:
        lines.append(f"{permuted} tables with the same grid on the same ranks, in another order")
    return lines
