"""Phases 1 and 2 of the search (driver.py runs all four): split and re-place, then polish.

Phase 1, split and re-place (after NVIDIA's planners): every model-parallel table starts as one
cell (table-wise). Each round, all cells are placed from scratch, longest first, onto the allowed
rank with the least estimated load that has memory left and, where possible, no other cell of the
same table (CostModel.cell_ms prices a cell); for row-split tables a second placement also keeps
each table's cells on the nodes it already uses, so that hierarchical reduction pays. The plan is
then scored exactly. The costliest rank (most lookups + communication) names the table that loads
it most; we try doubling its row slices and
doubling its column slices, for it alone and for it with its twins (identical tables), and keep
whichever gives the lower estimated step time, even when that
is worse than the current plan, because on a plateau of equally loaded ranks a cut pays only once
its twins are cut too. After `patience` rounds without a new best, the best plan seen wins.

Phase 2, polish: local moves on the costliest ranks (cut one cell's row or column slice onto a light
rank, or move the cell: moves.cell_moves, the same moves phase 3 tries), each applied only if it lowers
the estimated step time.

Each round of phases 1 and 2 is linear in the tables, so that models of 50,000 tables plan in minutes: the
cells of tables whose shape did not change keep their order (the few others are merged in); a
placement keeps each table's cell ranks, and a one-cell table's load is its load on rank 0
renumbered, added into the plan's total in table order a stack of tables at a time
(CostModel.add_in_order), so that the total is CostModel.rank_load's to the last bit; a table's
further cells look at the ranks of its own nodes directly, not down the heap; the costliest rank's
tables come from the placement and twins from groups built once. The state keeps, per rank, the tables
with a cell there.

"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import numpy as np

from ..cost.load import RankLoad
from ..layout.groups import ShardingGroup
from ..layout.tables import PlanError, TableLayout, WirePrecision
from .moves import cell_moves, cells_on, even_grid, light_ranks
from ..cost.objective import Objective, better, objective
from ..progress import Progress
from .config import SearchStats
from .state import SearchState, better_move

Shape = tuple[int, int]  # (row slices, column slices)
Grid = tuple[tuple[int, ...], ...]  # the rank of each cell, [row slice][column slice]
Cell = tuple[float, int, int, int, str, float, int, bool]  # see SplitRounds._cells


@dataclass
class _Cells:
    """A table's unplaced grid (every cell on rank 0) and its cells; a one-cell grid also keeps the
    sharding groups of its load (whose columns SplitRounds._one_cell keeps)."""

    grid: TableLayout
    cells: list[Cell]
    groups: Mapping[ShardingGroup, int] | None = None


@dataclass
class _Placement:
    """A phase-1 plan: each movable table's shape and the rank of each of its cells, the movable
    tables with a cell on each rank, and the layouts, built when asked for."""

    shapes: dict[str, Shape]
    grids: dict[str, Grid]
    holders: dict[int, list[str]]
    cell_ranks: np.ndarray  # per movable table, in order: the rank of its cell if it has one, else -1
    layouts: dict[str, TableLayout] = field(default_factory=dict)


class SplitRounds:
    """Phases 1 (the first placement, then the split rounds) on a search state: it leaves the best
    placement seen in the state. Its caches (unplaced grids and their cells, one-cell tables' load
    columns, the last cells sorted) live as long as the phase."""

    def __init__(self, stats: SearchStats, progress: Progress | None = None) -> None:
        self.stats = stats
        self.progress = progress

    def prepare(self, state: SearchState) -> None:
        """Reads what the phase needs of the state and builds the twins' groups (done by run)."""
        self.state = state
        everyone_key = tuple(range(state.world_size))
        self._twin_groups: dict[tuple, list[str]] = {}
        self._twin_key: dict[str, tuple] = {}
        for n in state.movable:
            c = state.constraints[n]
            key = (
                state.cost.signature[n],
                state.clusters[n],
                everyone_key if c.ranks is None else tuple(state.allowed[n].tolist()),
                self._precision(n),
                (c.row_cuts, c.column_cuts, c.grid_cuts, c.min_column_width),
            )
            self._twin_key[n] = key
            self._twin_groups.setdefault(key, []).append(n)
        self._shapes: dict[str, Shape] = {}
        self._cell_cache: dict[tuple[str, Shape], _Cells] = {}
        self._last_sorted: tuple[dict[str, Shape], list[Cell]] = ({}, [])
        self.unplaced: list[str] = []
        # per movable table: its one-cell load's CostModel.one_cell_columns, filled when first scored
        self._columns = np.zeros((len(state.movable),) + state.cost.one_cell_columns(state.fixed_total).shape)

    # ---- helpers ----------------------------------------------------------------------------

    def _precision(self, name: str) -> WirePrecision:
        return self.state.precision(name, self.state.clusters[name])

    def _report(self, stage: str, done: int, total: int | None, note: str = "") -> None:
        if self.progress is not None:
            self.progress(stage, done, total, note)

    def _grid(self, name: str, shape: Shape) -> TableLayout:
        return even_grid(self.state, name, self.state.clusters[name], shape)

    def _cells(self, name: str, shape: Shape) -> _Cells:
        """The unplaced grid of a table and its cells as (-cost ms, table order, r, c, name, bytes,
        width, one cell?): sorted, longest first, by the first four, which no two cells share.
        Memoised: a round re-places every table but changes the shape of few."""
        key = (name, shape)
        entry = self._cell_cache.get(key)
        if entry is None:
            grid = self._grid(name, shape)
            ms = self.state.cost.cell_ms(name, grid)
            order = self.state.order[name]
            single = grid.num_row_slices * grid.num_col_slices == 1
            cells = []
            for r in range(grid.num_row_slices):
                for c in range(grid.num_col_slices):
                    width = grid.col_bounds[c + 1] - grid.col_bounds[c]
                    need = (grid.row_bounds[r + 1] - grid.row_bounds[r]) * self.state.cost.row_memory(name, width)
                    cells.append((-float(ms[r, c]), order, r, c, name, need, width, single))
            entry = self._cell_cache[key] = _Cells(grid, cells)
        return entry

    def placed_layout(self, placement: _Placement, name: str) -> TableLayout:
        layout = placement.layouts.get(name)
        if layout is None:
            grid = self._cells(name, placement.shapes[name]).grid
            layout = placement.layouts[name] = self.state.hierarchy(name, grid.with_ranks(placement.grids[name]))
        return layout

    def _one_cell(self, name: str, entry: _Cells) -> Mapping[ShardingGroup, int]:
        """A one-cell table's sharding groups; the first call keeps its load on rank 0's
        CostModel.one_cell_columns in self._columns, which give its load on any rank (the whole loads
        are not kept: 50,000 tables' take 800 MB at 256 ranks)."""
        if entry.groups is None:
            base = self.state.cost.table_load(name, entry.grid)
            self._columns[self.state.order[name]] = self.state.cost.one_cell_columns(base)
            entry.groups = base.groups
        return entry.groups

    def score(self, placement: _Placement) -> tuple[Objective, RankLoad]:
        """The placement's objective and per-rank total: the fixed tables' sum, then each movable
        table's load added in table order, as CostModel.rank_load adds them (CostModel.add_in_order,
        a one-cell table's from its load on rank 0)."""
        self.stats.evaluations += 1
        self.stats.tables_summed += len(self.state.movable)
        total = self.state.fixed_total.copy()
        full: dict[int, np.ndarray] = {}
        table_groups: list[Mapping[ShardingGroup, int]] = []
        for j, name in enumerate(self.state.movable):
            entry = self._cells(name, placement.shapes[name])
            if entry.cells[0][-1]:
                table_groups.append(self._one_cell(name, entry))
            else:
                load = self.state.cost.table_load(name, self.placed_layout(placement, name))
                full[j] = load.rows
                table_groups.append(load.groups)
        self.state.cost.add_in_order(total.rows, self._columns, placement.cell_ranks, full)
        groups = total.groups
        for group, n in ((group, n) for g in table_groups for group, n in g.items()):
            groups[group] = groups.get(group, 0) + n
        return objective(self.state.cost.step_cost(total)), total

    # ---- phase 1: split and re-place ----------------------------------------------------------

    def _sorted_cells(self, shapes: Mapping[str, Shape]) -> list[Cell]:
        """Every movable cell, longest first. Shapes differ from the last ones sorted in a few
        tables: their cells are dropped and the new ones merged in (Timsort merges the two sorted
        runs in linear time) rather than sorting every cell again."""
        last_shapes, last_cells = self._last_sorted
        changed = [n for n in self.state.movable if shapes[n] != last_shapes.get(n)]
        if 2 * len(changed) > len(self.state.movable):
            cells = sorted(c for n in self.state.movable for c in self._cells(n, shapes[n]).cells)
        else:
            gone = set(changed)
            cells = [c for c in last_cells if c[4] not in gone]
            cells += sorted(c for n in changed for c in self._cells(n, shapes[n]).cells)
            cells.sort()
        self._last_sorted = (dict(shapes), cells)
        return cells

    def _place(self, shapes: Mapping[str, Shape], local_first: bool = False) -> _Placement | None:
        """Longest-cell-first placement of every movable cell; None when memory runs out.

        A cell goes to the least loaded allowed rank with room; a cell of a table of several cells
        (all of one width on a rank) prefers a rank that holds none of the table's cells, and with
        local_first, of those, one on a node that already holds one, where a hierarchical reduction
        keeps their partial sums off the network. Ranks come off a heap of (load, rank) in that
        order; the ranks of a table's own nodes are looked at directly (a rank chosen so leaves its
        old heap entry behind, stale by its version)."""
        cells = self._sorted_cells(shapes)
        s = self.state
        memory = s.fixed_memory.tolist()
        cap, lws, world, allowed_set = s.cap, s.local_world_size, s.world_size, s.allowed_set
        one_cell: dict[str, int] = {}  # rank of each one-cell table
        grids: dict[str, list[list[int]]] = {}  # ranks of the cells of the others
        holds: dict[str, set[int]] = {}
        nodes: dict[str, set[int]] = {}  # local_first: the nodes that hold cells of a table
        near: dict[str, set[int]] = {}  # and their ranks that hold none
        width_on: dict[str, dict[int, int]] = {}  # one cell width per table on a rank
        holders: dict[int, list[str]] = {k: [] for k in range(world)}
        loads = [0.0] * world  # estimated load of each rank
        versions = [0] * world
        heap = [(0.0, k, 0) for k in range(world)]  # (load, rank, version): least loaded first
        probes = 0
        self.unplaced = []
        for neg_ms, _, r, c, name, need, width, single in cells:
            allowed = allowed_set[name]
            popped = []
            choice = None
            if single:  # the least loaded allowed rank with room
                while heap:
                    entry = heapq.heappop(heap)
                    k = entry[1]
                    if entry[2] != versions[k]:
                        continue
                    if (allowed is None or k in allowed) and memory[k] + need <= cap:
                        choice = k
                        break
                    popped.append(entry)
                probes += len(popped) + (choice is not None)
            else:
                held = holds.setdefault(name, set())
                widths = width_on.setdefault(name, {})
                if local_first and held:  # the least loaded rank of the table's nodes that holds none of its cells
                    fitting = [
                        (loads[k], k)
                        for k in near[name]
                        if (allowed is None or k in allowed)
                        and memory[k] + need <= cap
                        and widths.get(k, width) == width
                    ]
                    probes += len(near[name])
                    choice = min(fitting)[1] if fitting else None
                if choice is None:  # the least loaded rank that holds none of its cells, else the least loaded
                    fallback = None
                    while heap:
                        entry = heapq.heappop(heap)
                        k = entry[1]
                        if entry[2] != versions[k]:
                            continue
                        popped.append(entry)
                        if (allowed is not None and k not in allowed) or memory[k] + need > cap:
                            continue
                        if widths.get(k, width) != width:
                            continue
                        if k not in held:
                            choice = k
                            break
                        if fallback is None:
                            fallback = k
                    probes += len(popped)
                    if choice is None:
                        choice = fallback
            for entry in popped:
                if entry[1] != choice:
                    heapq.heappush(heap, entry)
            if choice is None:
                self.unplaced.append(name)
                continue
            k = choice
            loads[k] -= neg_ms
            versions[k] += 1
            heapq.heappush(heap, (loads[k], k, versions[k]))
            if single:
                one_cell[name] = k
            else:
                grid = grids.get(name)
                if grid is None:
                    n_r, n_c = shapes[name]
                    grid = grids[name] = [[0] * n_c for _ in range(n_r)]
                grid[r][c] = k
                if local_first:
                    ranks_near = near.setdefault(name, set())
                    if k // lws not in nodes.setdefault(name, set()):
                        nodes[name].add(k // lws)
                        ranks_near.update(q for q in range(k - k % lws, k - k % lws + lws) if q not in held)
                    ranks_near.discard(k)
                held.add(k)
                widths[k] = width
            holders[k].append(name)
            memory[k] += need
        self.stats.placements += 1
        self.stats.cells_placed += len(cells)
        self.stats.rank_probes += probes
        if self.unplaced:
            return None
        placed = {n: ((one_cell[n],),) if n in one_cell else tuple(map(tuple, grids[n])) for n in s.movable}
        cell_ranks = np.array([one_cell.get(n, -1) for n in s.movable], dtype=np.int64)
        return _Placement(dict(shapes), placed, holders, cell_ranks)

    def _splits(self, name: str, shape: Shape) -> Iterator[Shape]:
        t = self.state.cost.table(name)
        c = self.state.constraints[name]
        n_r, n_c = shape
        limit = min(self.state.world_size, len(self.state.allowed[name]))
        if c.row_cuts and (n_c == 1 or c.grid_cuts) and 2 * n_r <= t.rows and 2 * n_r * n_c <= limit:
            yield (2 * n_r, n_c)
        if (
            c.column_cuts
            and (n_r == 1 or c.grid_cuts)
            and 2 * n_c <= t.dim // c.min_column_width
            and 2 * n_r * n_c <= limit
        ):
            yield (n_r, 2 * n_c)

    def _costliest_table(self, placement: _Placement, total: RankLoad) -> str | None:
        """The splittable movable table that loads the costliest rank most (its tables' loads on that
        rank priced together: CostModel.rank_load_ms is elementwise)."""
        rank = int(np.argmax(self.state.cost.step_cost(total).rank_load_ms))
        on_rank = dict.fromkeys(placement.holders[rank])
        self.stats.tables_scanned += len(on_rank)
        names = [n for n in on_rank if next(self._splits(n, placement.shapes[n]), None)]
        if not names:
            return None
        columns = []
        for n in names:
            entry = self._cells(n, placement.shapes[n])
            if entry.cells[0][-1]:  # its load on rank 0 renumbered: every rank off its node loads alike
                self._one_cell(n, entry)
                k = placement.grids[n][0][0]
                lws = self.state.local_world_size
                column = (rank - k) % lws if rank // lws == k // lws else lws
                columns.append(self._columns[self.state.order[n]][:, column])
            else:
                columns.append(self.state.cost.table_load(n, self.placed_layout(placement, n)).rows[:, rank])
        loads = self.state.cost.rank_load_ms(np.stack(columns, axis=1))
        return max((float(ms), -self.state.order[n], n) for ms, n in zip(loads, names))[2]

    def _twins(self, name: str) -> list[str]:
        """Movable tables identical to `name` for the cost model (same sizes, traffic, cluster,
        shape, allowed ranks and cuts allowed): models repeat tables, and twins tie on a plateau, so
        a round also tries cutting them all at once."""
        shape = self._shapes[name]
        return [n for n in self._twin_groups[self._twin_key[name]] if self._shapes[n] == shape]

    def _least_shape(self, name: str) -> Shape:
        """The fewest (row, column) slices the table's constraints ask for; refused by name when the
        table cannot hold them. They ask for slices, not ranks: cells of a table may share a rank (as
        TorchRec's grid_shard puts several column slices on each rank of a node), as long as they are
        equally wide (a rank holds one column width of a table)."""
        c = self.state.constraints[name]
        n_r, n_c = c.min_cuts
        t = self.state.cost.table(name)
        if n_r > t.rows or n_c > t.dim // c.min_column_width:
            raise PlanError(
                f"table {name!r}: its constraints ask for at least {n_r} x {n_c} slices (columns at least "
                f"{c.min_column_width} wide), which {t.rows} rows x dim {t.dim} cannot hold"
            )
        ranks = min(self.state.world_size, len(self.state.allowed[name]))
        bounds = self._grid(name, (n_r, n_c)).col_bounds
        widths = sorted({b - a for a, b in zip(bounds, bounds[1:])})
        if n_r * n_c > ranks and len(widths) > 1:
            raise PlanError(
                f"table {name!r}: its constraints ask for at least {n_r} x {n_c} slices, more than its {ranks} allowed "
                f"ranks, so its cells share ranks, but dim {t.dim} cuts into columns {widths} wide and a rank holds "
                f"one width of a table: allow {n_r * n_c} ranks or more, or a dim that is a multiple of {4 * n_c}"
            )
        return (n_r, n_c)

    def initial_placement(self) -> tuple[dict[str, Shape], _Placement]:
        """Table-wise; while some cells find no rank with memory, row-split the tables they belong
        to (or, when those cannot be cut further, the table with the largest slices)."""
        s = self.state
        shapes = self._shapes = {n: self._least_shape(n) for n in s.movable}

        def can_grow(n: str) -> bool:
            return (2 * shapes[n][0], shapes[n][1]) in set(self._splits(n, shapes[n]))

        while True:
            self._report("placing", self.stats.placements, None)
            placement = self._place(shapes)
            if placement is not None:
                return shapes, placement
            unplaced = list(dict.fromkeys(self.unplaced))
            growing = [n for n in unplaced if can_grow(n)]
            if not growing:
                largest = [(s.cost.table(n).rows / shapes[n][0], n) for n in s.movable if can_grow(n)]
                growing = [max(largest)[1]] if largest else []
            if not growing:
                need = sum(s.cost.table(n).rows * s.cost.row_memory(n, s.cost.table(n).dim) for n in s.movable)
                raise PlanError(
                    f"tables {unplaced} do not fit: the model-parallel tables need {need / 1e9:.1f} GB of weights and "
                    f"optimizer state, beside {s.fixed_memory.max() / 1e9:.1f} GB per rank "
                    "of data-parallel and fixed "
                    f"tables, on {s.world_size} ranks of {s.cap / 1e9:.1f} GB"
                )
            for n in growing:
                shapes[n] = (2 * shapes[n][0], shapes[n][1])

    def run(self, state: SearchState) -> None:
        self.prepare(state)
        self._shapes, placement = self.initial_placement()
        score, total = self.score(placement)
        self.stats.initial_step_ms = state.cost.step_cost(total).step_ms
        best = current = (score, placement, total)
        stalled = 0
        while stalled < state.config.patience and self.stats.rounds < state.config.max_rounds:
            self._report("split rounds", self.stats.rounds, None, f"best {best[0][0]:.3f} ms")
            name = self._costliest_table(current[1], current[2])
            if name is None:
                break
            self.stats.rounds += 1
            options = []
            twins = self._twins(name)
            for shape in self._splits(name, self._shapes[name]):
                for group in ([name], twins) if len(twins) > 1 else ([name],):
                    trial = {**self._shapes, **{n: shape for n in group}}
                    for local_first in (False, True) if shape[0] > 1 else (False,):
                        placed = self._place(trial, local_first)
                        if placed is not None:
                            options.append((self.score(placed), trial, placed))
            if not options:
                break
            (score, total), self._shapes, placement = min(options, key=lambda o: o[0][0])
            current = (score, placement, total)
            if better(score, best[0]):
                best = current
                stalled = 0
            else:
                stalled += 1
        _, placement, total = best
        layouts = dict(state.fixed)
        for name in state.movable:
            layouts[name] = self.placed_layout(placement, name)
        state.set_plan(layouts, total)


class Polish:
    """Phase 2 on a search state: local moves on the costliest ranks' heaviest cells (moves.cell_moves
    onto the least loaded ranks), each taken only if it lowers the objective."""

    def __init__(self, stats: SearchStats, progress: Progress | None = None) -> None:
        self.stats = stats
        self.progress = progress
        self._cell_ms: dict[tuple[str, TableLayout], np.ndarray] = {}

    def _heaviest_cells(self, state: SearchState, rank: int) -> list[tuple[str, int, int]]:
        scored = []
        names = state.holders[rank]
        self.stats.tables_scanned += len(names)
        for name in names:
            layout = state.layouts[name]
            ms = self._cell_ms.get((name, layout))
            if ms is None:
                ms = self._cell_ms[(name, layout)] = state.cost.cell_ms(name, layout)
            order = state.order[name]
            scored += [(-float(ms[r, c]), order, r, c) for r, c in cells_on(layout, rank)]
        scored.sort()
        return [(state.names[o], r, c) for _, o, r, c in scored[: state.config.cells_per_rank]]

    def run(self, state: SearchState) -> None:
        config = state.config
        current = objective(state.cost.step_cost(state.total))
        for move in range(config.polish_moves):
            if self.progress is not None:
                self.progress("polishing", move, config.polish_moves, f"best {current[0]:.3f} ms")
            step = state.cost.step_cost(state.total)
            measures = ((step.rank_load_ms, config.placement_candidates),)
            comm = step.rank_intra_ms + step.rank_inter_ms
            worst = dict.fromkeys(int(np.argmax(a)) for a in (step.rank_load_ms, step.rank_lookup_ms, comm))
            best = None
            priced = state.priced
            for name, r, c, k in (cell + (k,) for k in worst for cell in self._heaviest_cells(state, k)):
                for layout in cell_moves(state, name, [(r, c)], light_ranks(state, name, measures, k)):
                    best = better_move(best, state.evaluate([(name, layout)]))
            self.stats.evaluations += state.priced - priced
            if best is None or not better(best.objective, current):
                return
            state.apply(best)
            current = best.objective
            self.stats.moves += 1
