"""EMBark's greedy 3D search.

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
rank, or move the cell), each applied only if it lowers the estimated step time.

Ties on step time are broken by the sum of squared per-rank loads. Every loop runs in a fixed
order, so the result is deterministic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Iterator, Mapping

import numpy as np

from .constraints import TableConstraints
from .cost import CostModel, RankLoad, StepCost
from .layout import Plan, PlanError, TableLayout, WirePrecision

Objective = tuple[float, float]
Shape = tuple[int, int]  # (row slices, column slices)


@dataclass(frozen=True)
class SearchConfig:
    patience: int = 16  # split rounds past the best plan seen before phase 1 stops
    max_rounds: int = 2000
    polish_moves: int = 200
    placement_candidates: int = 6  # least loaded ranks tried for a cut or moved cell in phase 2
    cells_per_rank: int = 2  # heaviest cells of each costliest rank that phase 2 tries to move
    dp_memory_fraction: float = 0.05
    precision: Mapping[str, WirePrecision] = field(default_factory=dict)  # per cluster; default fp32


@dataclass
class SearchStats:
    rounds: int = 0
    moves: int = 0
    evaluations: int = 0
    initial_step_ms: float = 0.0


class GreedySearch:
    """One search for one model, topology and cluster assignment."""

    def __init__(
        self,
        cost: CostModel,
        clusters: Mapping[str, str],
        constraints: Mapping[str, TableConstraints],
        config: SearchConfig,
    ) -> None:
        self.cost = cost
        self.clusters = dict(clusters)
        self.constraints = constraints
        self.config = config
        self.world_size = cost.topology.world_size
        self.cap = cost.topology.hbm_cap_bytes
        self.stats = SearchStats()
        self._shapes: dict[str, Shape] = {}
        self.fixed: dict[str, TableLayout] = {}
        self.movable: list[str] = []
        for t in cost.spec.tables:
            c = self.constraints.get(t.name, TableConstraints())
            if c.layout is not None:
                self.fixed[t.name] = c.layout
            elif self.clusters[t.name] == "dp":
                self.fixed[t.name] = TableLayout.data_parallel(self._precision(t.name))
            else:
                self.movable.append(t.name)
        self._hier_cache: dict[TableLayout, bool] = {}
        self._allowed_set = {n: set(self._allowed(n)) for n in self.movable}
        self._lws = cost.topology.local_world_size
        self._order = {n: i for i, n in enumerate(self.movable)}
        self._cell_cache: dict[tuple[str, Shape], tuple[TableLayout, list]] = {}
        self._fixed_memory = np.zeros(self.world_size)
        for name, layout in self.fixed.items():
            self._fixed_memory += cost.table_load(name, layout).memory
        self.unplaced: list[str] = []
        # state of the plan under construction (phase 2 updates it one table at a time)
        self.layouts: dict[str, TableLayout] = {}
        self.loads: dict[str, RankLoad] = {}
        self.total = RankLoad.zeros(self.world_size)

    # ---- helpers ----------------------------------------------------------------------------

    def _allowed(self, name: str) -> list[int]:
        ranks = self.constraints.get(name, TableConstraints()).ranks
        return sorted(set(ranks)) if ranks is not None else list(range(self.world_size))

    def _precision(self, name: str) -> WirePrecision:
        c = self.constraints.get(name, TableConstraints())
        return c.precision or self.config.precision.get(self.clusters[name], WirePrecision())

    def _objective(self, step: StepCost) -> Objective:
        loads = step.rank_load_ms
        return step.step_ms, float(np.dot(loads, loads))

    def _grid(self, name: str, shape: Shape) -> TableLayout:
        """An even R x C grid (columns on multiples of 4) with every cell on rank 0, to be placed."""
        t = self.cost.table(name)
        n_r, n_c = shape
        rows = tuple(round(i * t.rows / n_r) for i in range(n_r + 1))
        quads = t.dim // 4
        cols = tuple(4 * round(i * quads / n_c) for i in range(n_c + 1))
        return TableLayout(self.clusters[name], rows, cols, ((0,) * n_c,) * n_r, self._precision(name))

    def _cells(self, name: str, shape: Shape) -> tuple[TableLayout, list[tuple[float, int, int, int, str, float]]]:
        """The unplaced grid of a table and its cells as (-cost ms, table order, r, c, name, bytes),
        memoised: a round re-places every table but changes the shape of few."""
        key = (name, shape)
        if key not in self._cell_cache:
            grid = self._grid(name, shape)
            ms = self.cost.cell_ms(name, grid)
            order = self._order[name]
            cells = []
            for r in range(grid.num_row_slices):
                for c in range(grid.num_col_slices):
                    width = grid.col_bounds[c + 1] - grid.col_bounds[c]
                    need = (grid.row_bounds[r + 1] - grid.row_bounds[r]) * self.cost.row_memory(name, width)
                    cells.append((-float(ms[r, c]), order, r, c, name, need))
            self._cell_cache[key] = (grid, cells)
        return self._cell_cache[key]

    def _hierarchy(self, name: str, layout: TableLayout) -> TableLayout:
        """Row-split RB tables reduce inside the node first when that lowers the table's own
        communication bottleneck, counting the extra collectives of the two-stage reduction."""
        if layout.cluster != "rb" or layout.num_row_slices < 2:
            return layout
        if layout not in self._hier_cache:
            flat, hier = (replace(layout, hierarchical=h) for h in (False, True))
            steps = [self.cost.step_cost(self.cost.table_load(name, v)) for v in (flat, hier)]
            ms = [step.comm_ms + step.collective_ms for step in steps]
            self._hier_cache[layout] = ms[1] < ms[0]
        return replace(layout, hierarchical=self._hier_cache[layout])

    def _score(self, layouts: Mapping[str, TableLayout]) -> tuple[Objective, dict[str, RankLoad], RankLoad]:
        self.stats.evaluations += 1
        loads = {n: self.cost.table_load(n, lay) for n, lay in layouts.items()}
        total = RankLoad.total(list(loads.values()), self.world_size)
        return self._objective(self.cost.step_cost(total)), loads, total

    # ---- phase 1: split and re-place ----------------------------------------------------------

    def _place(self, shapes: Mapping[str, Shape], local_first: bool = False) -> dict[str, TableLayout] | None:
        """Longest-cell-first placement of every movable cell; None when memory runs out.

        local_first puts a table's further cells on the nodes that already hold one, where a
        hierarchical reduction keeps their partial sums off the network."""
        memory = self._fixed_memory.tolist()
        grids = {name: self._cells(name, shapes[name])[0] for name in self.movable}
        cells = sorted(c for name in self.movable for c in self._cells(name, shapes[name])[1])
        placed = {n: [[0] * g.num_col_slices for _ in range(g.num_row_slices)] for n, g in grids.items()}
        holds: dict[str, set[int]] = {n: set() for n in grids}
        width_on: dict[str, dict[int, int]] = {n: {} for n in grids}  # one cell width per table on a rank
        heap = [(0.0, k) for k in range(self.world_size)]  # (estimated load, rank): least loaded first
        self.unplaced = []
        for neg_ms, _, r, c, name, need in cells:
            allowed, held = self._allowed_set[name], holds[name]
            bounds = grids[name].col_bounds
            width, widths = bounds[c + 1] - bounds[c], width_on[name]
            nodes = {k // self._lws for k in held} if local_first and held else None
            popped, best = [], [None, None, None]  # least loaded rank at each preference level
            while heap:
                load, k = heapq.heappop(heap)
                popped.append((load, k))
                if k not in allowed or memory[k] + need > self.cap or widths.get(k, width) != width:
                    continue
                level = 2 if k in held else 0 if nodes is None or k // self._lws in nodes else 1
                if best[level] is None:
                    best[level] = (load, k)
                if level == 0:
                    break
            choice = next((b for b in best if b is not None), None)
            for entry in popped:
                if entry != choice:
                    heapq.heappush(heap, entry)
            if choice is None:
                self.unplaced.append(name)
                continue
            load, k = choice
            heapq.heappush(heap, (load - neg_ms, k))
            placed[name][r][c] = k
            held.add(k)
            widths[k] = width
            memory[k] += need
        if self.unplaced:
            return None
        layouts = dict(self.fixed)
        for name in self.movable:
            grid = grids[name].with_ranks(tuple(map(tuple, placed[name])))
            layouts[name] = self._hierarchy(name, grid)
        return layouts

    def _splits(self, name: str, shape: Shape) -> Iterator[Shape]:
        t = self.cost.table(name)
        c = self.constraints.get(name, TableConstraints())
        n_r, n_c = shape
        limit = min(self.world_size, len(self._allowed(name)))
        if c.row_cuts and (n_c == 1 or c.grid_cuts) and 2 * n_r <= t.rows and 2 * n_r * n_c <= limit:
            yield (2 * n_r, n_c)
        if (
            c.column_cuts
            and (n_r == 1 or c.grid_cuts)
            and 2 * n_c <= t.dim // c.min_column_width
            and 2 * n_r * n_c <= limit
        ):
            yield (n_r, 2 * n_c)

    def _costliest_table(
        self, layouts: Mapping[str, TableLayout], loads: Mapping[str, RankLoad], total: RankLoad
    ) -> str | None:
        """The splittable movable table that loads the costliest rank most."""
        rank = int(np.argmax(self.cost.step_cost(total).rank_load_ms))
        on_rank = [
            (float(self.cost.step_cost(loads[n]).rank_load_ms[rank]), -i, n)
            for i, n in enumerate(self.movable)
            if rank in layouts[n].used_ranks() and next(self._splits(n, self._shapes[n]), None)
        ]
        return max(on_rank)[2] if on_rank else None

    def _twins(self, name: str) -> list[str]:
        """Movable tables identical to `name` for the cost model (same sizes, traffic, cluster,
        shape, allowed ranks and cuts allowed): models repeat tables, and twins tie on a plateau, so
        a round also tries cutting them all at once."""

        def signature(n: str) -> tuple:
            c = self.constraints.get(n, TableConstraints())
            return (
                self.cost.signature[n],
                self.clusters[n],
                self._shapes[n],
                tuple(self._allowed(n)),
                self._precision(n),
                (c.row_cuts, c.column_cuts, c.grid_cuts, c.min_column_width),
            )

        key = signature(name)
        return [n for n in self.movable if signature(n) == key]

    def _least_shape(self, name: str) -> Shape:
        """The fewest (row, column) slices the table's constraints ask for; refused by name when the
        table or its allowed ranks cannot hold them."""
        c = self.constraints.get(name, TableConstraints())
        n_r, n_c = c.min_cuts
        t = self.cost.table(name)
        ranks = min(self.world_size, len(self._allowed(name)))
        if n_r > t.rows or n_c > t.dim // c.min_column_width or n_r * n_c > ranks:
            raise PlanError(
                f"table {name!r}: its constraints ask for at least {n_r} x {n_c} slices (columns at least "
                f"{c.min_column_width} wide), which {t.rows} rows x dim {t.dim} on {ranks} allowed ranks cannot hold"
            )
        return (n_r, n_c)

    def _initial_shapes(self) -> tuple[dict[str, Shape], dict[str, TableLayout]]:
        """Table-wise; while some cells find no rank with memory, row-split the tables they belong
        to (or, when those cannot be cut further, the table with the largest slices)."""
        shapes = self._shapes = {n: self._least_shape(n) for n in self.movable}

        def can_grow(n: str) -> bool:
            return (2 * shapes[n][0], shapes[n][1]) in set(self._splits(n, shapes[n]))

        while True:
            layouts = self._place(shapes)
            if layouts is not None:
                return shapes, layouts
            unplaced = list(dict.fromkeys(self.unplaced))
            growing = [n for n in unplaced if can_grow(n)]
            if not growing:
                largest = [(self.cost.table(n).rows / shapes[n][0], n) for n in self.movable if can_grow(n)]
                growing = [max(largest)[1]] if largest else []
            if not growing:
                need = sum(
                    self.cost.table(n).rows * self.cost.row_memory(n, self.cost.table(n).dim) for n in self.movable
                )
                raise PlanError(
                    f"tables {unplaced} do not fit: the model-parallel tables need {need / 1e9:.1f} GB of weights and "
                    f"optimizer state, beside {self._fixed_memory.max() / 1e9:.1f} GB per rank "
                    "of data-parallel and fixed "
                    f"tables, on {self.world_size} ranks of {self.cap / 1e9:.1f} GB"
                )
            for n in growing:
                shapes[n] = (2 * shapes[n][0], shapes[n][1])

    def _split_rounds(self) -> None:
        self._shapes, layouts = self._initial_shapes()
        current = self._score(layouts)
        self.stats.initial_step_ms = self.cost.step_cost(current[2]).step_ms
        best = (current[0], layouts, current[1], current[2])
        stalled = 0
        while stalled < self.config.patience and self.stats.rounds < self.config.max_rounds:
            name = self._costliest_table(layouts, current[1], current[2])
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
                            options.append((self._score(placed), trial, placed))
            if not options:
                break
            current, self._shapes, layouts = min(options, key=lambda o: o[0][0])
            if _better(current[0], best[0]):
                best = (current[0], layouts, current[1], current[2])
                stalled = 0
            else:
                stalled += 1
        _, self.layouts, self.loads, self.total = best

    # ---- phase 2: polish -------------------------------------------------------------------------

    def _least_loaded(self, name: str, exclude: int) -> list[int]:
        loads = self.cost.step_cost(self.total).rank_load_ms
        allowed = [k for k in self._allowed(name) if k != exclude]
        allowed.sort(key=lambda k: (loads[k], k))
        return allowed[: self.config.placement_candidates]

    def _moves(self, name: str, r: int, c: int, rank: int) -> Iterator[TableLayout]:
        """Cut the cell's row or column slice with the new half on a light rank q (where the table's
        constraints allow that cut), or move it to q."""
        layout = self.layouts[name]
        con = self.constraints.get(name, TableConstraints())
        r0, r1 = layout.row_bounds[r], layout.row_bounds[r + 1]
        c0, c1 = layout.col_bounds[c], layout.col_bounds[c + 1]
        half = (c1 - c0) // 8 * 4
        cut_rows = con.row_cuts and (layout.num_col_slices == 1 or con.grid_cuts) and r1 - r0 >= 2
        cut_cols = con.column_cuts and (layout.num_row_slices == 1 or con.grid_cuts)
        cut_cols = cut_cols and min(half, c1 - c0 - half) >= con.min_column_width
        row = layout.ranks[r]
        column = tuple(layout.ranks[i][c] for i in range(layout.num_row_slices))
        for q in self._least_loaded(name, exclude=rank):
            if cut_rows:
                yield layout.split_rows(r, (r0 + r1) // 2, row[:c] + (q,) + row[c + 1 :])
            if cut_cols:
                yield layout.split_cols(c, c0 + half, column[:r] + (q,) + column[r + 1 :])
            grid = [list(cells) for cells in layout.ranks]
            grid[r][c] = q
            yield layout.with_ranks(tuple(tuple(cells) for cells in grid))

    def _heaviest_cells(self, rank: int) -> list[tuple[str, int, int]]:
        scored = []
        for order, name in enumerate(self.movable):
            layout = self.layouts[name]
            if rank not in layout.used_ranks():
                continue
            ms = self.cost.cell_ms(name, layout)
            scored += [
                (-float(ms[r, c]), order, r, c)
                for r, row in enumerate(layout.ranks)
                for c, k in enumerate(row)
                if k == rank
            ]
        scored.sort()
        return [(self.movable[o], r, c) for _, o, r, c in scored[: self.config.cells_per_rank]]

    def _try(self, name: str, layout: TableLayout) -> tuple[Objective, TableLayout, RankLoad, RankLoad] | None:
        if layout.mixed_width_rank() is not None:
            return None
        self.stats.evaluations += 1
        layout = self._hierarchy(name, layout)
        new = self.cost.table_load(name, layout)
        total = self.total.copy()
        total.add(self.loads[name], -1.0)
        total.add(new)
        if total.memory.max() > self.cap:
            return None
        return self._objective(self.cost.step_cost(total)), layout, new, total

    def _polish(self) -> None:
        current = self._objective(self.cost.step_cost(self.total))
        for _ in range(self.config.polish_moves):
            step = self.cost.step_cost(self.total)
            comm = step.rank_intra_ms + step.rank_inter_ms
            worst = dict.fromkeys(int(np.argmax(a)) for a in (step.rank_load_ms, step.rank_lookup_ms, comm))
            best = None
            for name, r, c, k in (cell + (k,) for k in worst for cell in self._heaviest_cells(k)):
                for layout in self._moves(name, r, c, k):
                    tried = self._try(name, layout)
                    if tried is not None and (best is None or _better(tried[0], best[1])):
                        best = (name,) + tried
            if best is None or not _better(best[1], current):
                return
            name, current, layout, new, total = best
            self.layouts[name], self.loads[name], self.total = layout, new, total
            self.stats.moves += 1

    def run(self) -> Plan:
        if self.movable:
            self._split_rounds()
            self._polish()
        else:
            self.layouts = dict(self.fixed)
        topo = self.cost.topology
        order = [t.name for t in self.cost.spec.tables]
        return Plan(topo.world_size, topo.local_world_size, {n: self.layouts[n] for n in order})


def _better(a: Objective, b: Objective) -> bool:
    """a beats b: a lower step time, or the same step time with flatter per-rank loads."""
    tol = 1e-9 * max(abs(b[0]), 1e-12)
    if a[0] < b[0] - tol:
        return True
    return abs(a[0] - b[0]) <= tol and a[1] < b[1] * (1 - 1e-9)
