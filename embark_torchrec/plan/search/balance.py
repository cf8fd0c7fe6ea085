"""Phase 4 of the search: spread the busiest rank's communication where it is far above the average rank's.

The step counts one rank's communication, the busiest's (StepCost.comm_ms is the maximum over ranks),
so the climb (improve.py) stops once that maximum cannot fall without the slowest rank's lookups or
the collectives rising as much, and may leave a few ranks (those holding the hottest one-cell tables,
or where a row split's partial sums meet) sending far more than the rest. Such a plan is as fast as
estimated only while every link runs as the cost model assumes: its busiest ranks' links are where a
slower link, contention or a straggler costs the step most, and a user reading per-rank traffic
sees the plan as unbalanced. So when the busiest rank's communication is more than
SearchConfig.comm_balance times the average rank's, this phase tries the moves of the busiest rank's
tables by communication (moves.py, as the climb tries them: cells moved or cut onto the ranks least
loaded by communication or by load, swaps, re-splits, re-cuts into many more slices, confinement to
fewer nodes) and takes the one that lowers the busiest rank's communication most (on a tie, the sum
of squared per-rank communication, so that a plateau of equally busy ranks comes down one rank at a
time), as long as the step stays within SearchConfig.balance_tolerance of the climb's plan. The
tolerance keeps the trade small: this stage spends at most that share of the step on balance, and
never trades more. It stops when the ratio is met, when no move lowers the busiest rank's
communication, or when its budget of priced candidates (SearchConfig.balance_evaluations) is spent;
a plan already within the ratio is left as it is, unpriced.

When those moves leave the ratio over, a second stage changes which nodes send what. A hierarchical
row split's column slice sends its stage 2 (the column's sums reduced in a node, once to every other
node) from every rank of each node holding a cell of it, so all of a node's ranks send for every
column any of them holds, and no move of one table's cells on the busiest rank lowers that while
another of its node's ranks keeps a cell of the column (on skewed DCNv2 at 128 GPUs: six nodes, each
with a cold 2 x 2 or 2 x 3 table and cells of another table's middle column, send for 168 columns of
width, the nodes full of hot cells for 40 to 88; the hot cells cannot go to ranks holding hot cells, whose
lookups would then set the step). So the stage sends each column slice's cells on the
SearchConfig.exchange_nodes nodes with the busiest ranks to another node (moves.node_exchanges): their ranks'
contents exchanged whole with as many ranks there (each rank's lookups and memory go with its contents,
unchanged), or the cells moved alone; it takes the move that lowers the busiest / average ratio most (on a
tie, the lower step) while the step stays within the climb's, then within SearchConfig.exchange_tolerance of
the best step yet (the first stage's where its moves also shortened the step, so that the exchanges never
spend that gain; both limits capped by the second), until the ratio is met, nothing lowers it or
SearchConfig.exchange_evaluations candidates are priced. The ratio falls because light nodes start sending for
more columns: the average rank's communication rises more than the busiest's (skewed DCNv2 at 128 GPUs: 0.225
-> 0.238 ms against 0.257 -> 0.261, ratio 1.14 -> 1.10, step +0.44%; DCNv2 at 128 GPUs reaches 1.10 within the
climb's step). That trade is worth its step only when it reaches the ratio, so the stage's moves are kept only
then (else the plan goes back to the first stage's), and its tolerance is wider than the first stage's.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

from ..cost.model import StepCost
from .moves import (
    cell_moves,
    cells_on,
    confinement,
    heaviest_tables,
    light_ranks,
    node_exchanges,
    recuts,
    reshapes,
    swaps,
)
from ..cost.objective import Objective, better
from ..progress import Progress
from .state import Changes, Move, SearchState


def comm_imbalance(step: StepCost) -> float:
    """The busiest rank's embedding communication (intra + inter-node ms) over the average rank's; 1.0 with none."""
    comm = step.rank_intra_ms + step.rank_inter_ms
    mean = float(comm.mean())
    return float(comm.max()) / mean if mean > 0 else 1.0


def comm_spread(step: StepCost) -> Objective:
    """What the first stage lowers: the busiest rank's communication, then the sum of squared per-rank communication."""
    comm = step.rank_intra_ms + step.rank_inter_ms
    return float(comm.max()), float(np.dot(comm, comm))


def ratio_then_step(step: StepCost) -> Objective:
    """What the second stage lowers: the busiest / average ratio, then the step."""
    return comm_imbalance(step), step.step_ms


class CommBalance:
    """Phase 4 on the plan under search, which it leaves at the most balanced plan it reached."""

    def __init__(self, progress: Progress | None = None) -> None:
        self.progress = progress
        self.moves = 0
        self.evaluations = 0  # candidates priced

    def _candidates(self, state: SearchState, step: StepCost) -> list[Changes]:
        """The moves of the tables that load the busiest rank's links most, re-split and re-cut cells
        placed onto the ranks least loaded by communication."""
        comm = step.rank_intra_ms + step.rank_inter_ms
        k = int(np.argmax(comm))
        cost = state.cost

        def comm_ms(rows: np.ndarray) -> np.ndarray:
            _, intra, inter = cost.rank_times(rows)
            return intra + inter

        n = state.config.improve_targets
        measures = ((comm, n), (step.rank_load_ms, n))
        changes: list[Changes] = []
        for name in heaviest_tables(state, k, comm=True):
            targets = light_ranks(state, name, measures, k)
            layouts = [*cell_moves(state, name, cells_on(state.layouts[name], k), targets)]
            layouts += reshapes(state, name, comm, comm_ms)
            layouts += recuts(state, name, comm, comm_ms)
            confined = confinement(state, name, step.rank_load_ms)
            if confined is not None:
                layouts.append(confined)
            changes += [[(name, layout)] for layout in layouts]
            changes += swaps(state, name, k, targets)
        return changes

    def _exchanges(self, state: SearchState, step: StepCost) -> Iterator[Changes]:
        """The column slices of the nodes with the busiest ranks sent to other nodes (moves.node_exchanges)."""
        lws = state.local_world_size
        node_ms = (step.rank_intra_ms + step.rank_inter_ms).reshape(-1, lws).max(axis=1)
        nodes = np.lexsort((np.arange(len(node_ms)), -node_ms))[: state.config.exchange_nodes]
        for n in nodes.tolist():
            yield from node_exchanges(state, n, node_ms, step.rank_load_ms)

    def run(self, state: SearchState) -> None:
        config = state.config
        step = state.cost.step_cost(state.total)
        if comm_imbalance(step) <= config.comm_balance:
            return
        start, climbed = state.priced, step.step_ms
        limit = climbed * (1.0 + config.balance_tolerance)
        step = self._climb(state, step, limit, config.balance_evaluations, self._candidates, comm_spread)
        if comm_imbalance(step) > config.comm_balance:
            before, moves, priced = state.snapshot(), self.moves, state.priced
            # within exchange_tolerance of the best step yet: a gain of the first stage is not the second's to spend
            cap = min(climbed, step.step_ms) * (1.0 + config.exchange_tolerance)
            for limit in (min(climbed, cap), cap):
                budget = config.exchange_evaluations - (state.priced - priced)
                step = self._climb(state, step, limit, budget, self._exchanges, ratio_then_step)
            if comm_imbalance(step) > config.comm_balance:
                state.restore(before)
                self.moves = moves
        self.evaluations = state.priced - start

    def _climb(
        self,
        state: SearchState,
        step: StepCost,
        limit: float,
        budget: int,
        candidates: Callable[[SearchState, StepCost], Iterable[Changes]],
        measure: Callable[[StepCost], Objective],
    ) -> StepCost:
        """One stage: the best candidate by `measure` (within the step limit) taken while it lowers that,
        the ratio is over and `budget` candidates are not yet priced (a round ends where it runs out: a
        node's column slices times the other nodes' grow with the tables); the plan's step at the end."""
        start = state.priced
        current = measure(step)
        while state.priced - start < budget and comm_imbalance(step) > state.config.comm_balance:
            if self.progress is not None:
                note = f"busiest / average communication {comm_imbalance(step):.2f}"
                self.progress("balancing", state.priced - start, budget, note)
            best: tuple[Objective, Move] | None = None
            for change in candidates(state, step):
                if state.priced - start >= budget:
                    break
                move = state.evaluate(change)
                if move is None or move.step.step_ms > limit:
                    continue
                value = measure(move.step)
                if best is None or better(value, best[0]):
                    best = (value, move)
            if best is None or not better(best[0], current):
                break
            current, move = best
            state.apply(move)
            step = move.step
            self.moves += 1
        return step
