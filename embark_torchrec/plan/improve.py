"""Phase 3 of the search: improve the greedy plan by exactly priced local moves.

The greedy phases place cells by an estimate of what each costs its holder and fix each table's
cluster early. Here every candidate is priced exactly (CostModel.table_load of the changed table's
new layout swapped into the plan's total) and each round takes the best move from the tables that
load the bottleneck ranks most (the slowest by lookups, by communication, by both):

- move one of the table's cells there to one of the least loaded ranks it may use, or cut the cell
  in two with the new half there (as phase 2 does);
- swap a one-cell table with a lighter one-cell table on a light rank;
- re-split the table with one row or column slice more or fewer, or twice or half as many, its
  cells placed again longest first onto the least loaded ranks (row-split RB tables also on the
  fewest least loaded nodes, where a hierarchical reduction pays);
- re-cluster it: RB <-> UB on the same grid, or to data-parallel.

When the bottleneck offers nothing, every table's re-clustering, and every re-split of the tables
of several cells, is tried (DP tables go back to model-parallel this way, split tables are merged), and
so is emptying a whole sharding group, or all of them, into one form (every table DP, table-wise, or
UB <-> RB): a group costs its collectives until its last table leaves, which no one-table move prices.
Every move keeps the table's constraints (allowed ranks, clusters, cuts, fewest slices, narrowest
columns, precision), one column width per table on a rank, every rank's memory, and the
data-parallel tables within dp_memory_fraction of a rank's memory, as clusters.py does; the best
move is taken only if it lowers the objective, and the best plan seen is what the phase returns, so
it never makes a plan worse. At a local optimum a seeded random kick (a bottleneck cell moved to a
random allowed rank) restarts the climb from the best plan while budget is left. The budget counts
priced candidates (SearchConfig.improve_evaluations), not seconds, so the result is deterministic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator

import numpy as np

from .bound import allowed_clusters
from .cost import RankLoad, StepCost
from .layout import TableLayout, WirePrecision
from .objective import Objective, better, objective
from .report import Progress

if TYPE_CHECKING:
    from .search import GreedySearch

Shape = tuple[int, int]
_KICK_TRIES = 8


@dataclass(frozen=True)
class _Move:
    """New layouts (and loads) for one or two tables, the plan's total with them, and its objective."""

    objective: Objective
    changes: tuple[tuple[str, TableLayout, RankLoad], ...]
    total: RankLoad


@dataclass(frozen=True)
class _State:
    """A plan to come back to: the objective, every layout and load, the total, DP memory used."""

    objective: Objective
    layouts: dict[str, TableLayout]
    loads: dict[str, RankLoad]
    total: RankLoad
    dp_used: float


class Improver:
    """Phase 3 on a search's finished plan (its layouts and total), which it updates in place."""

    def __init__(self, search: "GreedySearch", progress: Progress | None = None) -> None:
        self.s = search
        self.progress = progress
        self.cost = search.cost
        self.config = search.config
        self.rng = np.random.default_rng(self.config.improve_seed)
        self.evaluations = 0
        self.kicks = 0
        # tables whose layout may change: the movable ones, and DP ones whose cluster was not forced
        free_dp = [n for n in search.fixed if search._con[n].layout is None and search._con[n].cluster is None]
        self.names = list(search.movable) + free_dp
        self.order = {n: i for i, n in enumerate(self.names)}
        self.loads = {n: self.cost.table_load(n, search.layouts[n]) for n in self.names}
        self.holders: dict[int, set[str]] = {k: set() for k in range(search.world_size)}
        for n in self.names:
            self._hold(n, search.layouts[n], True)
        everyone = np.arange(search.world_size)
        self.allowed = {
            n: everyone if search._con[n].ranks is None else np.array(sorted(set(search._con[n].ranks)))
            for n in self.names
        }
        self.dp_budget = self.config.dp_memory_fraction * search.cap
        self.dp_used = sum(self._weights(n) for n, layout in search.layouts.items() if layout.cluster == "dp")

    # ---- bookkeeping -------------------------------------------------------------------------

    def _weights(self, name: str) -> float:
        """A DP copy's bytes on every rank: what the DP memory budget counts."""
        t = self.cost.table(name)
        return t.rows * self.cost.row_memory(name, t.dim)

    def _hold(self, name: str, layout: TableLayout, holds: bool) -> None:
        """Records (or forgets) the ranks the table has cells on: a bottleneck rank's tables are looked up there."""
        if layout.cluster != "dp":
            for k in layout.used_ranks():
                (self.holders[k].add if holds else self.holders[k].discard)(name)

    def _precision(self, name: str, cluster: str) -> WirePrecision:
        """The table's wire precision in a cluster: its own, else the cluster's (as the search sets them)."""
        return self.s._con[name].precision or self.config.precision.get(cluster, WirePrecision())

    def _state(self, current: Objective) -> _State:
        return _State(current, dict(self.s.layouts), dict(self.loads), self.s.total, self.dp_used)

    def _restore(self, state: _State) -> None:
        for name in self.names:
            layout = state.layouts[name]
            if self.s.layouts[name] is not layout:
                self._hold(name, self.s.layouts[name], False)
                self._hold(name, layout, True)
                self.s.layouts[name] = layout
        self.loads, self.s.total, self.dp_used = dict(state.loads), state.total, state.dp_used

    def _spent(self) -> bool:
        """Whether the budget of priced candidates is used up."""
        return self.evaluations >= self.config.improve_evaluations

    def _evaluate(self, changes: list[tuple[str, TableLayout]]) -> _Move | None:
        """The plan with these tables' layouts changed; None when a rank's memory, the one width per
        table on a rank or the DP memory budget would be broken."""
        if any(layout.cluster != "dp" and layout.mixed_width_rank() is not None for _, layout in changes):
            return None
        total = self.s.total.copy()
        out = []
        dp_used = self.dp_used
        for name, layout in changes:
            layout = self.s._hierarchy(name, layout)
            dp_used += self._weights(name) * ((layout.cluster == "dp") - (self.s.layouts[name].cluster == "dp"))
            new = self.cost.table_load(name, layout)
            total.add(self.loads[name], -1.0)
            total.add(new)
            out.append((name, layout, new))
        if dp_used > max(self.dp_budget, self.dp_used) or total.memory.max() > self.s.cap:
            return None
        self.evaluations += 1
        return _Move(objective(self.cost.step_cost(total)), tuple(out), total)

    def _apply(self, move: _Move) -> None:
        for name, layout, load in move.changes:
            old = self.s.layouts[name]
            self.dp_used += self._weights(name) * ((layout.cluster == "dp") - (old.cluster == "dp"))
            self._hold(name, old, False)
            self._hold(name, layout, True)
            self.s.layouts[name] = layout
            self.loads[name] = load
        self.s.total = move.total

    # ---- candidates ----------------------------------------------------------------------------

    def _light_ranks(self, name: str, measures: tuple[np.ndarray, ...], exclude: int) -> list[int]:
        """The allowed ranks but `exclude` least loaded by each measure (load, lookups, communication)."""
        ranks = self.allowed[name]
        ranks = ranks[ranks != exclude]
        out: dict[int, None] = {}
        for loads, n in zip(measures, (self.config.improve_targets, 1, 1)):
            out.update(dict.fromkeys(ranks[np.lexsort((ranks, loads[ranks]))[:n]].tolist()))
        return list(out)

    def _cell_moves(self, name: str, rank: int, targets: list[int]) -> Iterator[TableLayout]:
        """Each of the table's cells on `rank` moved to a target, or cut in half with the new half there."""
        layout = self.s.layouts[name]
        con = self.s._con[name]
        cells = layout.num_row_slices * layout.num_col_slices
        room = len(self.allowed[name])
        for r, row in enumerate(layout.ranks):
            for c, k in enumerate(row):
                if k != rank:
                    continue
                r0, r1 = layout.row_bounds[r], layout.row_bounds[r + 1]
                c0, c1 = layout.col_bounds[c], layout.col_bounds[c + 1]
                half = (c1 - c0) // 8 * 4
                cut_rows = con.row_cuts and (layout.num_col_slices == 1 or con.grid_cuts) and r1 - r0 >= 2
                cut_rows = cut_rows and cells + layout.num_col_slices <= room
                cut_cols = con.column_cuts and (layout.num_row_slices == 1 or con.grid_cuts)
                cut_cols = cut_cols and min(half, c1 - c0 - half) >= con.min_column_width
                cut_cols = cut_cols and cells + layout.num_row_slices <= room
                column = tuple(layout.ranks[i][c] for i in range(layout.num_row_slices))
                for q in targets:
                    grid = [list(cells) for cells in layout.ranks]
                    grid[r][c] = q
                    yield layout.with_ranks(tuple(map(tuple, grid)))
                    if cut_rows:
                        yield layout.split_rows(r, (r0 + r1) // 2, row[:c] + (q,) + row[c + 1 :])
                    if cut_cols:
                        yield layout.split_cols(c, c0 + half, column[:r] + (q,) + column[r + 1 :])

    def _shapes(self, name: str, layout: TableLayout) -> Iterator[Shape]:
        """One row or column slice more or fewer, or twice or half as many, as the table's
        constraints allow."""
        con = self.s._con[name]
        t = self.cost.table(name)
        n_r, n_c = layout.num_row_slices, layout.num_col_slices
        shapes = ((n_r + 1, n_c), (n_r - 1, n_c), (n_r, n_c + 1), (n_r, n_c - 1))
        shapes += ((2 * n_r, n_c), (n_r // 2, n_c), (n_r, 2 * n_c), (n_r, n_c // 2))
        for r, c in dict.fromkeys(shapes):
            if r < con.min_cuts[0] or c < con.min_cuts[1] or r * c > len(self.allowed[name]):
                continue
            if r > t.rows or c > t.dim // con.min_column_width:
                continue
            if (r > 1 and not con.row_cuts) or (c > 1 and not con.column_cuts) or (r > 1 < c and not con.grid_cuts):
                continue
            yield r, c

    def _placed(
        self, name: str, cluster: str, shape: Shape, rank_ms: np.ndarray, local: bool = False
    ) -> TableLayout | None:
        """An even grid of the table, its cells placed longest first, one per rank, onto the allowed
        ranks least loaded without the table and with memory for them; None when memory runs out.
        `local`: only on the fewest least loaded nodes that have ranks enough, so that a
        hierarchical reduction keeps partial sums inside them."""
        t = self.cost.table(name)
        n_r, n_c = shape
        rows = tuple(round(i * t.rows / n_r) for i in range(n_r + 1))
        quads = t.dim // 4
        cols = tuple(4 * round(i * quads / n_c) for i in range(n_c + 1))
        grid = TableLayout(cluster, rows, cols, ((0,) * n_c,) * n_r, self._precision(name, cluster))
        ms = self.cost.cell_ms(name, grid)
        base = rank_ms - self.cost.rank_load_ms(self.loads[name].rows)
        memory = self.s.total.memory - self.loads[name].memory
        ranks = self.allowed[name]
        if local:
            lws = self.cost.topology.local_world_size
            nodes = ranks // lws
            node_ms = np.bincount(nodes, weights=base[ranks], minlength=self.cost.topology.num_nodes)
            node_ranks = np.bincount(nodes, minlength=self.cost.topology.num_nodes)
            chosen, room = [], 0
            for n in np.lexsort((np.arange(len(node_ms)), node_ms / np.maximum(node_ranks, 1))):
                if room >= n_r * n_c or not node_ranks[n]:
                    continue
                chosen.append(n)
                room += node_ranks[n]
            ranks = ranks[np.isin(nodes, chosen)]
        heap = list(zip(base[ranks].tolist(), ranks.tolist()))
        heapq.heapify(heap)
        placed = [[0] * n_c for _ in range(n_r)]
        for _, r, c in sorted((-float(ms[r, c]), r, c) for r in range(n_r) for c in range(n_c)):
            need = (rows[r + 1] - rows[r]) * self.cost.row_memory(name, cols[c + 1] - cols[c])
            skipped = []
            while heap and memory[heap[0][1]] + need > self.s.cap:
                skipped.append(heapq.heappop(heap))
            if not heap:
                return None
            k = heapq.heappop(heap)[1]  # not pushed back: one cell of the table per rank
            for entry in skipped:
                heapq.heappush(heap, entry)
            placed[r][c] = k
            memory[k] += need
        return grid.with_ranks(tuple(map(tuple, placed)))

    def _reshapes(self, name: str, rank_ms: np.ndarray) -> Iterator[TableLayout]:
        """The table re-split (see _shapes) and placed, anywhere and, when row-split RB, node by node."""
        layout = self.s.layouts[name]
        for shape in self._shapes(name, layout):
            for local in (False, True) if layout.cluster == "rb" and shape[0] > 1 else (False,):
                placed = self._placed(name, layout.cluster, shape, rank_ms, local)
                if placed is not None:
                    yield placed

    def _reclusters(self, name: str, rank_ms: np.ndarray) -> Iterator[TableLayout]:
        """The table in each other cluster its constraints allow: DP, or RB / UB on the same grid
        (from DP: its fewest slices, placed)."""
        layout = self.s.layouts[name]
        for cluster in allowed_clusters(self.s._con[name]):
            if cluster == layout.cluster:
                continue
            if cluster == "dp":
                yield TableLayout.data_parallel(self._precision(name, "dp"))
            elif layout.cluster == "dp":
                placed = self._placed(name, cluster, self.s._con[name].min_cuts, rank_ms)
                if placed is not None:
                    yield placed
            else:
                yield replace(layout, cluster=cluster, precision=self._precision(name, cluster), hierarchical=False)

    def _heaviest_tables(self, rank: int) -> list[str]:
        """The tables with a cell on `rank` that load it most, heaviest first (ties in table order)."""
        names = sorted(self.holders[rank], key=self.order.__getitem__)
        if not names:
            return []
        ms = self.cost.rank_load_ms(np.stack([self.loads[n].rows[:, rank] for n in names], axis=1))
        ranked = sorted(zip((-ms).tolist(), (self.order[n] for n in names), names))
        return [n for _, _, n in ranked[: self.config.improve_tables]]

    def _swaps(self, name: str, rank: int, targets: list[int]) -> Iterator[tuple[str, int]]:
        """Per target rank, its heaviest one-cell table lighter than `name` on `rank` that may go there."""
        mine = float(self.cost.rank_load_ms(self.loads[name].rows[:, rank : rank + 1])[0])
        for q in targets:
            options = []
            for other in self.holders[q]:
                layout = self.s.layouts[other]
                allowed = self.s._con[other].ranks
                if layout.num_row_slices * layout.num_col_slices != 1 or (allowed is not None and rank not in allowed):
                    continue
                theirs = float(self.cost.rank_load_ms(self.loads[other].rows[:, q : q + 1])[0])
                if theirs < mine:
                    options.append((-theirs, self.order[other], other))
            if options:
                yield min(options)[2], q

    # ---- the climb -------------------------------------------------------------------------------

    def _bottleneck_move(self, step: StepCost) -> _Move | None:
        """The best move of the tables that load the bottleneck ranks most."""
        comm = step.rank_intra_ms + step.rank_inter_ms
        measures = (step.rank_load_ms, step.rank_lookup_ms, comm)
        worst = dict.fromkeys(int(np.argmax(a)) for a in (step.rank_lookup_ms, comm, step.rank_load_ms))
        best = None
        for k in worst:
            for name in self._heaviest_tables(k):
                layout = self.s.layouts[name]
                targets = self._light_ranks(name, measures, k)
                changes = [[(name, c)] for c in self._cell_moves(name, k, targets)]
                changes += [[(name, c)] for c in self._reshapes(name, step.rank_load_ms)]
                changes += [[(name, c)] for c in self._reclusters(name, step.rank_load_ms)]
                if layout.num_row_slices * layout.num_col_slices == 1:
                    for other, q in self._swaps(name, k, targets):
                        changes.append(
                            [(name, layout.with_ranks(((q,),))), (other, self.s.layouts[other].with_ranks(((k,),)))]
                        )
                for change in changes:
                    best = _best(best, self._evaluate(change))
                if self._spent():
                    return best
        return best

    def _group_of(self, name: str) -> str:
        (kind,) = self.loads[name].groups
        return kind

    def _dissolutions(self, rank_ms: np.ndarray) -> Iterator[list[tuple[str, TableLayout]]]:
        """Each sharding group of movable tables, and all of them at once, emptied in one move: all its
        tables data-parallel, or table-wise (placed one after another onto the least loaded ranks), or
        UB <-> RB on the same grids. A group's collectives cost the step only while one table is left in
        it, which no single-table move can change, so these are priced whole (when every table of the
        group may take the form)."""
        groups: dict[str, list[str]] = {}
        for name in self.names:
            groups.setdefault(self._group_of(name), []).append(name)
        if len(groups) > 1:
            groups[""] = list(self.names)
        for names in groups.values():
            clusters = {self.s.layouts[n].cluster for n in names}
            allowed = [allowed_clusters(self.s._con[n]) for n in names]
            if clusters != {"dp"} and all("dp" in a for a in allowed):
                yield [(n, TableLayout.data_parallel(self._precision(n, "dp"))) for n in names]
            if all("rb" in a and self.s._con[n].min_cuts == (1, 1) for n, a in zip(names, allowed)):
                whole = self._table_wise(names, rank_ms)
                if whole is not None and any(self.s.layouts[n] != layout for n, layout in whole):
                    yield whole
            for source, target in (("ub", "rb"), ("rb", "ub")):
                if clusters == {source} and all(target in a for a in allowed):
                    yield [
                        (n, replace(self.s.layouts[n], cluster=target, precision=self._precision(n, target)))
                        for n in names
                    ]

    def _table_wise(self, names: list[str], rank_ms: np.ndarray) -> list[tuple[str, TableLayout]] | None:
        """The tables each whole on one rank, the costliest first onto the least loaded allowed rank
        (counting the ones placed before it); None when memory runs out."""
        own = {name: self.cost.rank_load_ms(self.loads[name].rows) for name in names}
        ms = rank_ms.copy()
        for name in names:
            ms -= own[name]
        out = []
        for name in sorted(names, key=lambda n: (-own[n].sum(), self.order[n])):
            placed = self._placed(name, "rb", (1, 1), ms + own[name])
            if placed is None:
                return None
            ms += self.cost.rank_load_ms(self.cost.table_load(name, placed).rows)
            out.append((name, placed))
        return out

    def _sweep_move(self, step: StepCost) -> _Move | None:
        """The best re-clustering of any table, re-split of any table of several cells, or dissolution
        of a sharding group."""
        best = None
        for change in self._dissolutions(step.rank_load_ms):
            best = _best(best, self._evaluate(change))
        for name in self.names:
            layouts = list(self._reclusters(name, step.rank_load_ms))
            if self.s.layouts[name].num_row_slices * self.s.layouts[name].num_col_slices > 1:
                layouts += self._reshapes(name, step.rank_load_ms)
            for layout in layouts:
                best = _best(best, self._evaluate([(name, layout)]))
            if self._spent():
                break
        return best

    def _kick(self) -> bool:
        """Moves a random cell of the most loaded rank's heaviest tables to a random allowed rank
        (a few tries, for one that fits); False when none did."""
        step = self.cost.step_cost(self.s.total)
        k = int(np.argmax(step.rank_load_ms))
        names = self._heaviest_tables(k)
        for _ in range(_KICK_TRIES if names else 0):
            name = names[int(self.rng.integers(len(names)))]
            allowed = self.allowed[name]
            q = int(allowed[int(self.rng.integers(len(allowed)))])
            layout = self.s.layouts[name]
            grid = tuple(tuple(q if cell == k else cell for cell in row) for row in layout.ranks)
            move = self._evaluate([(name, layout.with_ranks(grid))]) if q != k else None
            if move is not None:
                self._apply(move)
                self.kicks += 1
                return True
        return False

    def run(self) -> int:
        """Improves the search's plan in place within the budget; returns the moves taken."""
        current = objective(self.cost.step_cost(self.s.total))
        best = self._state(current)
        moves = 0
        swept = False  # whether the best plan has been swept (every table re-clustered and re-split) as the best
        while not self._spent():
            if self.progress is not None:
                note = f"best {best.objective[0]:.3f} ms"
                self.progress("improving", self.evaluations, self.config.improve_evaluations, note)
            step = self.cost.step_cost(self.s.total)
            move = self._bottleneck_move(step)
            if (move is None or not better(move.objective, current)) and not swept:
                move = _best(move, self._sweep_move(step))
                swept = current == best.objective
            if move is not None and better(move.objective, current):
                self._apply(move)
                current = move.objective
                moves += 1
                if better(current, best.objective):
                    best = self._state(current)
                    swept = False
                continue
            self._restore(best)  # a local optimum: kick the best plan seen, and climb again
            if not self._kick():
                break
            current = objective(self.cost.step_cost(self.s.total))
        self._restore(best)
        return moves


def _best(a: _Move | None, b: _Move | None) -> _Move | None:
    """The better of two moves, either of which may be missing; a on a tie (the first priced wins)."""
    if a is None:
        return b
    return b if b is not None and better(b.objective, a.objective) else a
