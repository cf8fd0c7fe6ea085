"""The search's moves: every new layout a phase tries for a table (or a group of tables), from one place.

Each generator reads the plan under search (SearchState) and yields layouts that keep the table's
constraints: its allowed ranks (a table of more cells than allowed ranks is never made), its cuts
(rows, columns, grids, the fewest slices, the narrowest columns), its clusters and its precision.
Memory and the one column width per table on a rank are checked when a move is priced
(SearchState.evaluate). Placements are longest cell first onto the least loaded allowed ranks with
memory left, one cell of the table per rank.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..cost.bound import allowed_clusters
from ..layout.kinds import DATA_PARALLEL_KIND, REDUCTION_KIND, UNIQUE_KIND, cluster_kind
from ..layout.groups import ShardingGroup, sharding_group
from ..layout.tables import TableLayout
from .state import Changes, SearchState

DP, RB, UB = DATA_PARALLEL_KIND.name, REDUCTION_KIND.name, UNIQUE_KIND.name

Shape = tuple[int, int]  # (row slices, column slices)
Measure = Callable[[np.ndarray], np.ndarray]  # per-rank ms of RankLoad rows (CostModel.rank_load_ms)


def even_grid(state: SearchState, name: str, cluster: str, shape: Shape) -> TableLayout:
    """An even R x C grid of the table (columns on multiples of 4) with every cell on rank 0, to be placed."""
    t = state.cost.table(name)
    n_r, n_c = shape
    rows = tuple(round(i * t.rows / n_r) for i in range(n_r + 1))
    quads = t.dim // 4
    cols = tuple(4 * round(i * quads / n_c) for i in range(n_c + 1))
    return TableLayout(cluster, rows, cols, ((0,) * n_c,) * n_r, state.precision(name, cluster))


def light_ranks(state: SearchState, name: str, measures: Sequence[tuple[np.ndarray, int]], exclude: int) -> list[int]:
    """The table's allowed ranks but `exclude`: for each (per-rank measure, n), the n least by it
    (ties to the lower rank), in that order, each once."""
    ranks = state.allowed[name]
    ranks = ranks[ranks != exclude]
    out: dict[int, None] = {}
    for loads, n in measures:
        out.update(dict.fromkeys(ranks[np.lexsort((ranks, loads[ranks]))[:n]].tolist()))
    return list(out)


def cell_moves(
    state: SearchState, name: str, cells: Iterable[tuple[int, int]], targets: list[int]
) -> Iterator[TableLayout]:
    """Each of these cells (row slice, column slice) moved to a target rank, or cut in half (its row
    slice, or its column slice) with the new half there, where the table's cuts and its allowed
    ranks leave room for one more slice."""
    layout = state.layouts[name]
    con = state.constraints[name]
    count = layout.num_row_slices * layout.num_col_slices
    room = len(state.allowed[name])
    for r, c in cells:
        r0, r1 = layout.row_bounds[r], layout.row_bounds[r + 1]
        c0, c1 = layout.col_bounds[c], layout.col_bounds[c + 1]
        half = (c1 - c0) // 8 * 4
        cut_rows = con.row_cuts and (layout.num_col_slices == 1 or con.grid_cuts) and r1 - r0 >= 2
        cut_rows = cut_rows and count + layout.num_col_slices <= room
        cut_cols = con.column_cuts and (layout.num_row_slices == 1 or con.grid_cuts)
        cut_cols = cut_cols and min(half, c1 - c0 - half) >= con.min_column_width
        cut_cols = cut_cols and count + layout.num_row_slices <= room
        row = layout.ranks[r]
        column = tuple(layout.ranks[i][c] for i in range(layout.num_row_slices))
        for q in targets:
            grid = [list(ranks) for ranks in layout.ranks]
            grid[r][c] = q
            yield layout.with_ranks(tuple(map(tuple, grid)))
            if cut_rows:
                yield layout.split_rows(r, (r0 + r1) // 2, row[:c] + (q,) + row[c + 1 :])
            if cut_cols:
                yield layout.split_cols(c, c0 + half, column[:r] + (q,) + column[r + 1 :])


def cells_on(layout: TableLayout, rank: int) -> list[tuple[int, int]]:
    """The (row slice, column slice) of each of the layout's cells on `rank`."""
    return [(r, c) for r, row in enumerate(layout.ranks) for c, k in enumerate(row) if k == rank]


def heaviest_tables(state: SearchState, rank: int, comm: bool = False) -> list[str]:
    """The SearchConfig.improve_tables tables with a cell on `rank` that load it most (by lookups and
    communication, or by communication alone), heaviest first (ties in table order)."""
    names = sorted(state.holders[rank], key=state.order.__getitem__)
    if not names:
        return []
    columns = np.stack([state.load(n).rows[:, rank] for n in names], axis=1)
    if comm:
        _, intra, inter = state.cost.rank_times(columns)
        ms = intra + inter
    else:
        ms = state.cost.rank_load_ms(columns)
    ranked = sorted(zip((-ms).tolist(), (state.order[n] for n in names), names))
    return [n for _, _, n in ranked[: state.config.improve_tables]]


def shapes_near(state: SearchState, name: str, layout: TableLayout) -> Iterator[Shape]:
    """One row or column slice more or fewer, or twice or half as many, as the table's constraints allow."""
    n_r, n_c = layout.num_row_slices, layout.num_col_slices
    shapes = ((n_r + 1, n_c), (n_r - 1, n_c), (n_r, n_c + 1), (n_r, n_c - 1))
    shapes += ((2 * n_r, n_c), (n_r // 2, n_c), (n_r, 2 * n_c), (n_r, n_c // 2))
    return (s for s in dict.fromkeys(shapes) if allows_shape(state, name, s))


def allows_shape(state: SearchState, name: str, shape: Shape) -> bool:
    """Whether the table's constraints, sizes and allowed ranks admit an even grid of this shape."""
    con = state.constraints[name]
    t = state.cost.table(name)
    r, c = shape
    if r < con.min_cuts[0] or c < con.min_cuts[1] or r * c > len(state.allowed[name]):
        return False
    if r > t.rows or c > t.dim // con.min_column_width:
        return False
    return not ((r > 1 and not con.row_cuts) or (c > 1 and not con.column_cuts) or (r > 1 < c and not con.grid_cuts))


def placed(
    state: SearchState,
    name: str,
    cluster: str,
    shape: Shape,
    rank_ms: np.ndarray,
    local: bool = False,
    measure: Measure | None = None,
) -> TableLayout | None:
    """An even grid of the table, its cells placed longest first, one per rank, onto the allowed
    ranks least loaded without the table and with memory for them; None when memory runs out.
    `local`: only on the fewest least loaded nodes that have ranks enough, so that a
    hierarchical reduction keeps partial sums inside them. `rank_ms`: each rank's load by
    `measure` (CostModel.rank_load_ms unless given), from which the table's own is taken out."""
    cost = state.cost
    measure = measure or cost.rank_load_ms
    grid = even_grid(state, name, cluster, shape)
    n_r, n_c = shape
    rows, cols = grid.row_bounds, grid.col_bounds
    ms = cost.cell_ms(name, grid)
    own = state.load(name)
    base = rank_ms - measure(own.rows)
    memory = state.total.memory - own.memory
    ranks = state.allowed[name]
    if local:
        lws = state.local_world_size
        nodes = ranks // lws
        node_ms = np.bincount(nodes, weights=base[ranks], minlength=cost.topology.num_nodes)
        node_ranks = np.bincount(nodes, minlength=cost.topology.num_nodes)
        chosen, room = [], 0
        for n in np.lexsort((np.arange(len(node_ms)), node_ms / np.maximum(node_ranks, 1))):
            if room >= n_r * n_c or not node_ranks[n]:
                continue
            chosen.append(n)
            room += node_ranks[n]
        ranks = ranks[np.isin(nodes, chosen)]
    heap = list(zip(base[ranks].tolist(), ranks.tolist()))
    heapq.heapify(heap)
    cells = [[0] * n_c for _ in range(n_r)]
    for _, r, c in sorted((-float(ms[r, c]), r, c) for r in range(n_r) for c in range(n_c)):
        need = (rows[r + 1] - rows[r]) * cost.row_memory(name, cols[c + 1] - cols[c])
        skipped = []
        while heap and memory[heap[0][1]] + need > state.cap:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        k = heapq.heappop(heap)[1]  # not pushed back: one cell of the table per rank
        for entry in skipped:
            heapq.heappush(heap, entry)
        cells[r][c] = k
        memory[k] += need
    return grid.with_ranks(tuple(map(tuple, cells)))


def reshapes(
    state: SearchState, name: str, rank_ms: np.ndarray, measure: Measure | None = None
) -> Iterator[TableLayout]:
    """The table re-split (shapes_near) and placed (by `measure`: see placed), anywhere and, when
    row-split RB, node by node."""
    layout = state.layouts[name]
    for shape in shapes_near(state, name, layout):
        for local in layout.kind.hierarchy_options(shape[0]):
            grid = placed(state, name, layout.cluster, shape, rank_ms, local, measure)
            if grid is not None:
                yield grid


def reclusters(state: SearchState, name: str, rank_ms: np.ndarray) -> Iterator[TableLayout]:
    """The table in each other cluster its constraints allow: DP, or RB / UB on the same grid
    (from DP: its fewest slices, placed)."""
    layout = state.layouts[name]
    con = state.constraints[name]
    for cluster in allowed_clusters(con):
        if cluster == layout.cluster:
            continue
        if cluster_kind(cluster).replicated:
            yield TableLayout(cluster, precision=state.precision(name, cluster))
        elif layout.kind.replicated:
            grid = placed(state, name, cluster, con.min_cuts, rank_ms)
            if grid is not None:
                yield grid
        else:
            yield replace(layout, cluster=cluster, precision=state.precision(name, cluster), hierarchical=False)


def swaps(state: SearchState, name: str, rank: int, targets: list[int]) -> Iterator[Changes]:
    """A one-cell table on `rank` swapped, per target rank, with that rank's heaviest one-cell table
    lighter than it there that may go to `rank`."""
    layout = state.layouts[name]
    if layout.num_row_slices * layout.num_col_slices != 1:
        return
    cost = state.cost
    mine = float(cost.rank_load_ms(state.load(name).rows[:, rank : rank + 1])[0])
    for q in targets:
        options = []
        for other in state.holders[q]:
            theirs_layout = state.layouts[other]
            allowed = state.constraints[other].ranks
            if theirs_layout.num_row_slices * theirs_layout.num_col_slices != 1:
                continue
            if allowed is not None and rank not in allowed:
                continue
            theirs = float(cost.rank_load_ms(state.load(other).rows[:, q : q + 1])[0])
            if theirs < mine:
                options.append((-theirs, state.order[other], other))
        if options:
            other = min(options)[2]
            yield [(name, layout.with_ranks(((q,),))), (other, state.layouts[other].with_ranks(((rank,),)))]


def group_under(state: SearchState, name: str, layout: TableLayout) -> ShardingGroup:
    """The sharding group the table runs in under this layout."""
    t = state.cost.table(name)
    return sharding_group(layout, t.rows, state.world_size, state.local_world_size, t.is_sequence)


def group_of(state: SearchState, name: str) -> ShardingGroup:
    """The sharding group the table runs in now."""
    (group,) = state.load(name).groups
    return group


def table_wise(state: SearchState, names: list[str], rank_ms: np.ndarray) -> Changes | None:
    """The tables each whole on one rank, the costliest first onto the least loaded allowed rank
    (counting the ones placed before it); None when memory runs out."""
    cost = state.cost
    own = {name: cost.rank_load_ms(state.load(name).rows) for name in names}
    ms = rank_ms.copy()
    for name in names:
        ms -= own[name]
    out = []
    for name in sorted(names, key=lambda n: (-own[n].sum(), state.order[n])):
        grid = placed(state, name, RB, (1, 1), ms + own[name])
        if grid is None:
            return None
        ms += cost.rank_load_ms(cost.table_load(name, grid).rows)
        out.append((name, grid))
    return out


def dissolutions(state: SearchState, rank_ms: np.ndarray, most: int | None = None) -> Iterator[Changes]:
    """Each sharding group of the tables that may change, and all of them at once, emptied in one
    move: all its tables data-parallel, or table-wise (placed one after another onto the least
    loaded ranks), or UB <-> RB on the same grids. A group's collectives cost the step only while
    one table is left in it, which no single-table move can change, so these are priced whole (when
    every table of the group may take the form). `most`: only the groups of at most that many
    tables (a move's work grows with its tables)."""
    groups: dict[ShardingGroup, list[str]] = {}
    for name in state.names:
        groups.setdefault(group_of(state, name), []).append(name)
    emptied = list(groups.values())
    if len(groups) > 1 and most is None:
        emptied.append(list(state.names))
    for names in emptied:
        if most is not None and len(names) > most:
            continue
        clusters = {state.layouts[n].cluster for n in names}
        allowed = [allowed_clusters(state.constraints[n]) for n in names]
        if clusters != {DP} and all(DP in a for a in allowed):
            yield [(n, TableLayout(DP, precision=state.precision(n, DP))) for n in names]
        if all(RB in a and state.constraints[n].min_cuts == (1, 1) for n, a in zip(names, allowed)):
            whole = table_wise(state, names, rank_ms)
            if whole is not None and any(state.layouts[n] != layout for n, layout in whole):
                yield whole
        for source, target in ((UB, RB), (RB, UB)):
            if clusters == {source} and all(target in a for a in allowed):
                yield [
                    (n, replace(state.layouts[n], cluster=target, precision=state.precision(n, target))) for n in names
                ]


def recut_shapes(state: SearchState, name: str, layout: TableLayout) -> Iterator[Shape]:
    """Other cuts in one move, where shapes_near only adds or drops a slice or doubles or halves:
    as many cells, or as many as a quarter, half or all of a node's ranks, or 2, 4, ... nodes' (up to
    every rank), each count as rows x columns for 1, 2, 4, ... column slices (narrower cells send
    narrower partial sums and vectors), as the table's constraints allow."""
    lws, world = state.local_world_size, state.world_size
    count = layout.num_row_slices * layout.num_col_slices
    counts = [count, lws // 4, lws // 2] + [lws * 2**i for i in range(max(1, world // lws).bit_length())]
    shapes = []
    for k in dict.fromkeys(c for c in counts if c >= 2 and c <= world):
        n_c = 1
        while n_c <= k:
            shapes.append((k // n_c, n_c))
            n_c *= 2
    current = (layout.num_row_slices, layout.num_col_slices)
    return (s for s in dict.fromkeys(shapes) if s != current and allows_shape(state, name, s))


def recuts(state: SearchState, name: str, rank_ms: np.ndarray, measure: Measure | None = None) -> Iterator[TableLayout]:
    """The table re-cut into many more slices (recut_shapes), each placed (by `measure`: see placed)
    on the fewest least loaded nodes that hold it (a row split then reduces inside them first) and,
    for cuts over several nodes, anywhere."""
    layout = state.layouts[name]
    if layout.kind.replicated:
        return
    for shape in recut_shapes(state, name, layout):
        for local in (True, False) if shape[0] * shape[1] > state.local_world_size else (True,):
            grid = placed(state, name, layout.cluster, shape, rank_ms, local, measure)
            if grid is not None:
                yield grid


def confinement(state: SearchState, name: str, rank_ms: np.ndarray) -> TableLayout | None:
    """The table's grid placed again on the fewest least loaded nodes that have ranks for it: its
    cells' traffic then stays inside them (a row split's partial sums reduce there first), where a
    placement by load alone spreads it over every node; None when it is on one node already, or
    memory runs out."""
    layout = state.layouts[name]
    lws = state.local_world_size
    cells = layout.num_row_slices * layout.num_col_slices
    if layout.kind.replicated or cells == 1 or len({k // lws for k in layout.used_ranks()}) <= -(-cells // lws):
        return None
    return placed(state, name, layout.cluster, (layout.num_row_slices, layout.num_col_slices), rank_ms, True)


def regroupings(
    state: SearchState, options: Sequence[tuple[float, str, TableLayout, ShardingGroup]], rank_ms: np.ndarray
) -> Iterator[Changes]:
    """Tables moved into another sharding group together. `options`: per priced one-table move, what
    it changes the step by, the table, its layout and its sharding group (a group's first table pays
    its collectives). Per group, the tables with a move into it that gain most, each by its best such
    move, or by its best move onto one node (tables that each keep their traffic inside a node, where
    each one's best move alone spreads it over all): the 2, 4, 8, ... of them and all. A group whose
    collectives no one table's saving pays for
    opens when several tables' savings together do; a group all of whose tables move closes. A
    row-split RB table also counts for the group of its other reduction (flat or hierarchical), which
    SearchState.hierarchy declines for the table alone when the group's collectives are not yet paid
    for. The moves are made together as placed_together places them, each table reduced as its
    layout says (SearchState.evaluate with decide_hierarchy False)."""
    best: dict[tuple[ShardingGroup, bool], dict[str, tuple[float, int, str, TableLayout]]] = {}
    lws = state.local_world_size
    for gain, name, layout, group in options:
        variants = [(layout, group)]
        if len(layout.kind.hierarchy_options(layout.num_row_slices)) > 1 and not state.cost.table(name).is_sequence:
            other = replace(layout, hierarchical=not layout.hierarchical)  # the group a hierarchy() alone declined
            variants.append((other, group_under(state, name, other)))
        one_node = not layout.kind.replicated and len({k // lws for k in layout.used_ranks()}) == 1
        for variant, target in variants:
            if target == group_under(state, name, state.layouts[name]):
                continue
            entry = (gain, state.order[name], name, variant)
            for key in ((target, False), (target, True)) if one_node else ((target, False),):
                here = best.setdefault(key, {})
                if name not in here or entry[:2] < here[name][:2]:
                    here[name] = entry
    for moves in best.values():
        ranked = [(name, layout) for _, _, name, layout in sorted(moves.values(), key=lambda e: e[:2])]
        n = 2
        while n < len(ranked):
            together = placed_together(state, ranked[:n], rank_ms)
            if together is not None:
                yield together
            n *= 2
        together = placed_together(state, ranked, rank_ms) if len(ranked) > 1 else None
        if together is not None:
            yield together


def placed_together(state: SearchState, changes: Changes, rank_ms: np.ndarray) -> Changes | None:
    """Moves priced one at a time, made at once: a layout that keeps the table's cells where they
    are stays; the others' grids are placed again one after another, the heaviest first, each onto
    the ranks least loaded counting the ones placed before it (on the fewest nodes where the move
    had kept it on as few), so that they do not all land on the ranks that were lightest alone.
    None when memory runs out."""
    cost, lws = state.cost, state.local_world_size
    own = {name: cost.rank_load_ms(state.load(name).rows) for name, _ in changes}
    ms = rank_ms.copy()
    for name, _ in changes:
        ms -= own[name]
    out = []
    for name, layout in sorted(changes, key=lambda c: (-own[c[0]].sum(), state.order[c[0]])):
        old = state.layouts[name]
        kept = layout.kind.replicated or (layout.row_bounds, layout.col_bounds, layout.ranks) == (
            old.row_bounds,
            old.col_bounds,
            old.ranks,
        )
        if not kept:
            cells = layout.num_row_slices * layout.num_col_slices
            local = len({k // lws for k in layout.used_ranks()}) <= -(-cells // lws) and cells > 1
            shape = (layout.num_row_slices, layout.num_col_slices)
            grid = placed(state, name, layout.cluster, shape, ms + own[name], local)
            if grid is None:
                return None
            layout = replace(grid, hierarchical=layout.hierarchical)
        ms += cost.rank_load_ms(cost.table_load(name, layout).rows)
        out.append((name, layout))
    return out


def regroup_alternatives(state: SearchState, name: str, rank_ms: np.ndarray) -> Iterator[TableLayout]:
    """A table in each model-parallel cluster it may take at each of its re-cuts (and, in another
    cluster, the shapes near its own), placed: what closing its group into another takes when its
    grid does not run there (reclusters keeps the grid, reshapes the cluster)."""
    layout = state.layouts[name]
    if layout.kind.replicated:
        return
    for cluster in allowed_clusters(state.constraints[name]):
        if cluster_kind(cluster).replicated:
            continue
        shapes = [*recut_shapes(state, name, layout)]
        if cluster != layout.cluster:
            shapes = [*shapes_near(state, name, layout), *shapes]
        for shape in dict.fromkeys(shapes):
            for local in cluster_kind(cluster).hierarchy_options(shape[0]):
                grid = placed(state, name, cluster, shape, rank_ms, local)
                if grid is not None:
                    yield grid


def spread_counts(state: SearchState) -> list[int]:
    """How many slices a spread cuts a table into: 2, 3, 4, half a node's ranks, a node's, two nodes'
    and one per node (a hot table's sending split over that many ranks), within the world."""
    lws, world = state.local_world_size, state.world_size
    counts = (2, 3, 4, lws // 2, lws, 2 * lws, world // lws)
    return sorted(k for k in set(counts) if 2 <= k <= world)


def spreads(state: SearchState, name: str, comm: np.ndarray, comm_ms: Measure) -> Iterator[TableLayout]:
    """The table re-cut into k slices (spread_counts) on the k ranks least loaded by communication
    (`comm`, per rank by `comm_ms`): RB column slices (each sends 1/k of every vector), UB row slices
    (each sends its distinct IDs' vectors), and RB row and UB column slices, as the table's clusters
    and cuts allow. A hot one-cell table's rank sends the table's whole output; a table's re-cuts
    (recuts) place by lookups and communication together and, run in one cluster, miss the counts and
    clusters that split its sending evenly over ranks with links to spare."""
    layout = state.layouts[name]
    if layout.kind.replicated:
        return
    clusters = allowed_clusters(state.constraints[name])
    current = (layout.cluster, layout.num_row_slices, layout.num_col_slices)
    for k in spread_counts(state):
        for cluster, shape in ((RB, (1, k)), (UB, (k, 1)), (RB, (k, 1)), (UB, (1, k))):
            if cluster not in clusters or (cluster, *shape) == current or not allows_shape(state, name, shape):
                continue
            grid = placed(state, name, cluster, shape, comm, False, comm_ms)
            if grid is not None:
                yield grid


def dp_batch(state: SearchState, size: int) -> Changes:
    """The `size` model-parallel tables with the fewest weight bytes (ties in table order) that may
    go data-parallel within the DP memory budget left, all made data-parallel: a DP table's lookups
    fall evenly on every rank and its all-reduce, the smaller the table the cheaper, runs hidden by
    the backward while that has room, so a batch of them turns coarse cells that tie the slowest
    ranks into load spread thin. Each table's move alone adds its lookups / world to every rank and
    takes its cell off one of the tied ranks only, a loss the climb never takes; fewer tables where
    fewer may go."""
    left = max(state.dp_budget - state.dp_used, 0.0)
    options = sorted(
        (state.dp_weights(n), state.order[n], n)
        for n in state.names
        if not state.layouts[n].kind.replicated and DP in allowed_clusters(state.constraints[n])
    )
    out: Changes = []
    for weights, _, name in options:
        if len(out) == size or weights > left:
            break
        left -= weights
        out.append((name, TableLayout(DP, precision=state.precision(name, DP))))
    return out


def exchanged(state: SearchState, pairs: Sequence[tuple[int, int]]) -> Changes | None:
    """Every model-parallel cell on each pair's first rank moved to its second and back: the ranks'
    contents exchanged whole, so each rank's lookups and memory go with them and only where the
    traffic crosses nodes changes; None when a table may not go to its new rank."""
    perm = {a: b for a, b in pairs} | {b: a for a, b in pairs}
    names = sorted({n for k in perm for n in state.holders[k]}, key=state.order.__getitem__)
    out: Changes = []
    for name in names:
        allowed = state.allowed_set[name]
        layout = state.layouts[name]
        ranks = tuple(tuple(perm.get(k, k) for k in row) for row in layout.ranks)
        if allowed is not None and any(k not in allowed for row in ranks for k in row):
            return None
        out.append((name, layout.with_ranks(ranks)))
    return out


def column_groups(state: SearchState, node: int) -> dict[tuple[str, int], list[int]]:
    """Per (table, column slice) of a hierarchical table with cells on `node`, the ranks of `node`
    holding them: the column's stage 2 leaves the node from all its ranks while any one holds a cell."""
    lws = state.local_world_size
    groups: dict[tuple[str, int], list[int]] = {}
    for k in range(node * lws, (node + 1) * lws):
        for name in sorted(state.holders[k], key=state.order.__getitem__):
            layout = state.layouts[name]
            if layout.hierarchical:
                for _, c in cells_on(layout, k):
                    groups.setdefault((name, c), []).append(k)
    return groups


def node_exchanges(state: SearchState, node: int, node_ms: np.ndarray, rank_ms: np.ndarray) -> Iterator[Changes]:
    """Each hierarchical column slice's cells on `node` sent to another node: their ranks exchanged
    whole (exchanged) with as many ranks there, those of one of its column slices (the two nodes swap
    which columns' stage 2 they send) or those with the fewest cells; or the cells moved alone onto
    the ranks there least loaded by `rank_ms` that hold none of the table. The other nodes: those that
    hold the column already (it then leaves `node` and no node starts sending it), and the
    SearchConfig.improve_targets nodes least loaded by `node_ms`."""
    lws = state.local_world_size
    nodes = np.arange(len(node_ms))
    light = [int(n) for n in nodes[np.lexsort((nodes, node_ms))] if n != node][: state.config.improve_targets]
    for (name, c), mine in column_groups(state, node).items():
        layout = state.layouts[name]
        allowed = state.allowed_set[name]
        holding = {layout.ranks[r][c] // lws for r in range(layout.num_row_slices)} - {node}
        for other in dict.fromkeys([*sorted(holding), *light]):
            ranks = np.arange(other * lws, (other + 1) * lws)
            fewest = sorted(ranks.tolist(), key=lambda k: (len(state.holders[k]), k))
            groups = [g for g in column_groups(state, other).values() if len(g) >= len(mine)]
            for group in [*groups, fewest]:
                change = exchanged(state, list(zip(mine, [*group, *(k for k in fewest if k not in group)])))
                if change is not None:
                    yield change
            free = [
                k
                for k in ranks[np.lexsort((ranks, rank_ms[ranks]))].tolist()
                if name not in state.holders[k] and (allowed is None or k in allowed)
            ]
            if len(free) >= len(mine):
                to = dict(zip(mine, free))
                grid = tuple(tuple(to.get(k, k) if j == c else k for j, k in enumerate(row)) for row in layout.ranks)
                yield [(name, layout.with_ranks(grid))]
