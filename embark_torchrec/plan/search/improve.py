"""Phase 3 of the search: improve the greedy plan by exactly priced moves (moves.py).

The greedy phases place cells by an estimate of what each costs its holder and fix each table's
cluster early. Here every candidate is priced exactly (SearchState.evaluate: CostModel.table_load of
the changed tables' new layouts swapped into the plan's total) and each round takes the best move
from the tables that load the bottleneck ranks most (the slowest by lookups, by both lookups and
communication, and the busiest by communication, whose tables are ranked by their communication):

- move one of the table's cells there to one of the least loaded ranks it may use, or cut the cell
  in two with the new half there (as phase 2 does);
- swap a one-cell table with a lighter one-cell table on a light rank;
- re-split the table with one row or column slice more or fewer, or twice or half as many, its
  cells placed again longest first onto the least loaded ranks (row-split RB tables also on the
  fewest least loaded nodes, where a hierarchical reduction pays);
- confine its grid to the fewest least loaded nodes;
- re-cluster it: RB <-> UB on the same grid, or to data-parallel;
- for the table that loads the slowest rank most, re-cut it into many more (or differently shaped)
  slices at once: up to a row split over a node or over every rank;

and the emptying of each sharding group of at most SMALL_DISSOLUTION tables (every table DP,
table-wise, or UB <-> RB): a group costs its collectives until its last table leaves, which no
one-table move prices. When those find nothing, every bottleneck table's re-cuts are tried; then the
plateau moves: the ranks within SearchConfig.plateau_share of the busiest by communication each have
their heaviest table by communication spread (re-cut into k column or row slices on the ranks least
loaded by communication, RB or UB: moves.spreads), all in one move, and those within it of the
slowest by lookups each have their heaviest table re-split, since while several ranks tie no one
table's move lowers the step; when those find nothing either, the sweep: every group's emptying and
all at once, every table's re-clustering, every re-split of the tables of several cells (DP tables
go back to model-parallel this way, split tables are merged), and tables moved into another sharding
group together (the 2, 4, 8, ... that gain most moving there, each by its best move priced alone),
which opens a group whose collectives several tables' savings pay for and closes one all of whose
tables leave. Every move keeps the table's constraints (allowed ranks, clusters, cuts, fewest
slices, narrowest columns, precision), one column width per table on a rank, every rank's memory,
and the data-parallel tables within dp_memory_fraction of a rank's memory, as clusters.py does; the
best move is taken only if it lowers the objective, and the best plan seen is what the phase
returns, so it never makes a plan worse. At a local optimum a seeded random kick (a bottleneck cell
moved to a random allowed rank) restarts the climb from the best plan while budget is left.

Then the DP batches (moves.dp_batch): from the best plan, the 4, 8, 16, 32 (SearchConfig.dp_batch_sizes)
model-parallel tables with the fewest weight bytes are made data-parallel at once and the climb runs
again (within SearchConfig.dp_batch_share of its budget), the best plan of all the climbs kept. A DP
table's lookups fall evenly on every rank and its all-reduce, while the backward hides it, costs the
step nothing, so a batch turns the coarse cells of small tables into load spread thin; made DP one at
a time each is a loss (its lookups added to every rank, its cell taken off one of the tied slowest
ranks), and so is the batch, but from it the climb re-places the big tables' cells into the room left
(on T180 at 128 GPUs: 8.349 -> 7.843 ms, the yardstick's best 7.964). The batches stop at the first
whose all-reduce shows in the step. Every budget counts priced candidates (SearchConfig.improve_budget
in all), not seconds, so the result is deterministic.
"""

from __future__ import annotations

import numpy as np

from ..cost.model import StepCost
from ..layout.groups import ShardingGroup
from .moves import (
    cell_moves,
    cells_on,
    confinement,
    dissolutions,
    dp_batch,
    group_of,
    heaviest_tables,
    light_ranks,
    reclusters,
    recuts,
    regroup_alternatives,
    regroupings,
    reshapes,
    spreads,
    swaps,
)
from ..cost.objective import Objective, better, objective
from ..progress import Progress
from .state import Changes, Move, SearchState, Snapshot, better_move

_KICK_TRIES = 8
SMALL_DISSOLUTION = 64  # tables of a sharding group whose dissolution every round of the climb tries
SMALL_GROUP = 4  # tables of a sharding group whose every table the sweep also tries in other clusters and shapes


def exposed_allreduce_ms(step: StepCost) -> float:
    """DDP's all-reduce not hidden by the backward, less the dense part's: it rises exactly when
    more of the data-parallel tables' all-reduce shows in the step."""
    return step.dp_allreduce_ms - step.overlap_ms


class Improvement:
    """Phase 3 on the plan under search, which it leaves at the best plan it saw."""

    def __init__(self, progress: Progress | None = None) -> None:
        self.progress = progress
        self.evaluations = 0  # candidates priced
        self.kicks = 0
        self.moves = 0
        self.batches = 0  # DP batches climbed from (run)
        self.state: SearchState | None = None  # the plan under search, while run() climbs
        self.rng = np.random.default_rng(0)  # of the kicks; run() seeds it with SearchConfig.improve_seed
        self._start = 0  # SearchState.priced when the climb began
        self._budget: int | None = None  # candidates the climb may price; None: SearchConfig.improve_evaluations

    def _spent(self) -> bool:
        """Whether the budget of priced candidates is used up."""
        budget = self.state.config.improve_evaluations if self._budget is None else self._budget
        return self.state.priced - self._start >= budget

    # ---- candidates ----------------------------------------------------------------------------

    def _bottleneck_move(self, step: StepCost, deep: bool = False) -> Move | None:
        """The best move of the tables that load the bottleneck ranks most (the busiest rank by
        communication: the tables that load its links most), the emptying of each sharding group of
        at most SMALL_DISSOLUTION tables (a few moves, each of many tables), and the re-cuts into many
        more (or differently shaped) slices at once of the table that loads the slowest rank most.
        `deep`: the moves tried when those found nothing, the re-cuts of every one of those tables."""
        s = self.state
        comm = step.rank_intra_ms + step.rank_inter_ms
        measures = ((step.rank_load_ms, s.config.improve_targets), (step.rank_lookup_ms, 1), (comm, 1))
        worst = {int(np.argmax(step.rank_lookup_ms)): False}
        worst.setdefault(int(np.argmax(comm)), True)
        slowest = int(np.argmax(step.rank_load_ms))
        worst.setdefault(slowest, False)
        best = None
        if not deep:
            for change in dissolutions(s, step.rank_load_ms, SMALL_DISSOLUTION):
                best = better_move(best, s.evaluate(change))
        for k, by_comm in worst.items():
            for i, name in enumerate(heaviest_tables(s, k, by_comm)):
                if deep:
                    changes = [[(name, c)] for c in recuts(s, name, step.rank_load_ms)]
                else:
                    targets = light_ranks(s, name, measures, k)
                    changes = [[(name, c)] for c in cell_moves(s, name, cells_on(s.layouts[name], k), targets)]
                    changes += [[(name, c)] for c in reshapes(s, name, step.rank_load_ms)]
                    confined = confinement(s, name, step.rank_load_ms)
                    if confined is not None:
                        changes.append([(name, confined)])
                    changes += [[(name, c)] for c in reclusters(s, name, step.rank_load_ms)]
                    changes += swaps(s, name, k, targets)
                    if i == 0 and k == slowest:  # the slowest rank's heaviest table: re-cut at once too
                        changes += [[(name, c)] for c in recuts(s, name, step.rank_load_ms)]
                for change in changes:
                    best = better_move(best, s.evaluate(change))
                if self._spent():
                    return best
        return best

    def _sweep_move(self, step: StepCost) -> Move | None:
        """The best dissolution of a sharding group (any, and all at once), re-clustering of any table,
        re-split of any table of several cells (and, for the
        tables of groups of at most SMALL_GROUP tables, each in another cluster at other shapes), or
        tables moved into another sharding group together (regroupings: a group opened or closed when
        no one table's move pays for its collectives)."""
        s = self.state
        best = None
        current = objective(step)[0]
        sizes: dict[ShardingGroup, int] = {}
        for name in s.names:
            group = group_of(s, name)
            sizes[group] = sizes.get(group, 0) + 1
        options = []
        for change in dissolutions(s, step.rank_load_ms):
            best = better_move(best, s.evaluate(change))
        for name in s.names:
            layouts = list(reclusters(s, name, step.rank_load_ms))
            if s.layouts[name].num_row_slices * s.layouts[name].num_col_slices > 1:
                layouts += reshapes(s, name, step.rank_load_ms)
            if sizes[group_of(s, name)] <= SMALL_GROUP:
                layouts += regroup_alternatives(s, name, step.rank_load_ms)
            for layout in layouts:
                move = s.evaluate([(name, layout)])
                if move is not None:
                    ((_, priced, load),) = move.changes
                    options.append((move.objective[0] - current, name, priced, next(iter(load.groups))))
                best = better_move(best, move)
            if self._spent():
                return best
        for change in regroupings(s, options, step.rank_load_ms):
            best = better_move(best, s.evaluate(change, decide_hierarchy=False))
        return best

    def _plateau_move(self, step: StepCost, by_comm: bool) -> Move | None:
        """The ranks on the plateau of the busiest by communication (`by_comm`) or by lookups (within
        SearchConfig.plateau_share of the busiest's ms, at most SearchConfig.plateau_ranks of them)
        each have their heaviest table changed, all in one move: by communication, spread
        (moves.spreads); by lookups, re-split (moves.reshapes). The step counts the busiest rank's
        communication and the slowest rank's lookups alone, so while two ranks tie no one table's
        move lowers it, and each one's side traffic (IDs sent to more holders) raises the other's:
        the climb prices every such move alone as a loss. The tables are chosen in turn, busiest
        rank first, each change the one that gives the lowest step with the plateau's ranks not yet
        handled left out of that maximum, on the plan with the changes chosen before it (the ranks
        reached when the budget runs out); the whole move is priced as any other."""
        s = self.state
        cost = s.cost

        def comm_ms(rows: np.ndarray) -> np.ndarray:
            _, intra, inter = cost.rank_times(rows)
            return intra + inter

        def busy(step: StepCost) -> tuple[np.ndarray, float]:
            """The per-rank ms the plateau is of, and the step's term it is the maximum of."""
            if by_comm:
                return step.rank_intra_ms + step.rank_inter_ms, step.comm_ms
            return step.rank_lookup_ms.copy(), step.lookup_ms

        ms_of, _ = busy(step)
        top = float(ms_of.max())
        order = np.lexsort((np.arange(len(ms_of)), -ms_of))
        share = 1.0 - s.config.plateau_share
        plateau = [int(k) for k in order[: s.config.plateau_ranks] if ms_of[k] >= top * share]
        changes: Changes = []
        chosen: Move | None = None
        for i, k in enumerate(plateau):
            names = [n for n in heaviest_tables(s, k, comm=by_comm) if all(n != m for m, _ in changes)]
            if not names:
                continue
            rest = plateau[i + 1 :]
            here = chosen.step if chosen is not None else step
            if by_comm:
                layouts = spreads(s, names[0], here.rank_intra_ms + here.rank_inter_ms, comm_ms)
            else:
                layouts = reshapes(s, names[0], here.rank_load_ms)
            best: tuple[float, Move] | None = None
            for layout in layouts:
                move = s.evaluate([*changes, (names[0], layout)])
                if move is None:
                    continue
                others, term = busy(move.step)
                others[rest] = 0.0
                ms = move.step.step_ms - term + float(others.max())
                if best is None or ms < best[0]:
                    best = (ms, move)
            if best is not None:
                chosen = best[1]
                changes = [(name, layout) for name, layout, _ in chosen.changes]
            if self._spent():
                break
        return chosen

    def _kick(self) -> bool:
        """Moves a random cell of the most loaded rank's heaviest tables to a random allowed rank
        (a few tries, for one that fits); False when none did."""
        s = self.state
        step = s.cost.step_cost(s.total)
        k = int(np.argmax(step.rank_load_ms))
        names = heaviest_tables(s, k)
        for _ in range(_KICK_TRIES if names else 0):
            name = names[int(self.rng.integers(len(names)))]
            allowed = s.allowed[name]
            q = int(allowed[int(self.rng.integers(len(allowed)))])
            layout = s.layouts[name]
            grid = tuple(tuple(q if cell == k else cell for cell in row) for row in layout.ranks)
            move = s.evaluate([(name, layout.with_ranks(grid))]) if q != k else None
            if move is not None:
                s.apply(move)
                self.kicks += 1
                return True
        return False

    # ---- the climb -------------------------------------------------------------------------------

    def _climb(self, budget: int, kick: bool = True) -> tuple[Snapshot, Objective]:
        """Climbs from the plan in the state until `budget` more candidates are priced, kicking at
        each local optimum; the best plan seen and its objective (the state is left anywhere).
        `kick` False (a DP batch's climb, which re-places cells after the first climb swept every
        table): no sweep, and a stop at the first local optimum."""
        s = self.state
        self._start, self._budget = s.priced, budget
        current = objective(s.cost.step_cost(s.total))
        best, best_objective = s.snapshot(), current
        swept = not kick  # whether the best plan has been swept (every table re-clustered and re-split) as the best
        while not self._spent():
            if self.progress is not None:
                note = f"best {best_objective[0]:.3f} ms"
                self.progress("improving", s.priced - self._start, budget, note)
            step = s.cost.step_cost(s.total)
            move = self._bottleneck_move(step)
            if move is None or not better(move.objective, current):
                move = better_move(move, self._bottleneck_move(step, deep=True))
            if move is None or not better(move.objective, current):
                for by_comm in (True, False):
                    move = better_move(move, self._plateau_move(step, by_comm))
            if (move is None or not better(move.objective, current)) and not swept:
                move = better_move(move, self._sweep_move(step))
                swept = current == best_objective
            if move is not None and better(move.objective, current):
                s.apply(move)
                current = move.objective
                self.moves += 1
                if better(current, best_objective):
                    best, best_objective = s.snapshot(), current
                    swept = False
                continue
            s.restore(best)  # a local optimum: kick the best plan seen, and climb again
            if not kick or not self._kick():
                break
            current = objective(s.cost.step_cost(s.total))
        return best, best_objective

    def run(self, state: SearchState) -> None:
        """Improves the plan in place: a climb within SearchConfig.improve_evaluations, then, from
        the best plan, each of SearchConfig.dp_batch_sizes smallest tables made data-parallel at once
        (moves.dp_batch) and a climb again within SearchConfig.dp_batch_share of that budget (less
        over more ranks than SearchConfig.dp_batch_ranks, in proportion), the best plan of them all
        kept. The batch leaves the climb's optimum for a worse plan the
        single moves climb from to a better one: on T180 at 128 GPUs the slowest ranks by lookups
        tie 22-fold, each holding cells no single move can place elsewhere. Batches stop at the
        first whose DP all-reduce is no longer hidden by the backward (or that does not fit), as any
        larger one would be too, and after one of fewer tables than asked for."""
        self.state = s = state
        self.rng = np.random.default_rng(s.config.improve_seed)
        start = s.priced
        best, best_objective = self._climb(s.config.improve_evaluations)
        budget = int(
            s.config.improve_evaluations * s.config.dp_batch_share * min(1.0, s.config.dp_batch_ranks / s.world_size)
        )
        for size in s.config.dp_batch_sizes if budget > 0 else ():
            s.restore(best)
            step = s.cost.step_cost(s.total)
            batch = dp_batch(s, size)
            move = s.evaluate(batch) if batch else None
            if move is None or exposed_allreduce_ms(move.step) > exposed_allreduce_ms(step) + 1e-9:
                break
            s.apply(move)
            self.batches += 1
            plan, reached = self._climb(budget, kick=False)
            if better(reached, best_objective):
                best, best_objective = plan, reached
            if len(batch) < size:  # every table that may go made DP: a larger batch is this one
                break
        s.restore(best)
        self.evaluations = s.priced - start
