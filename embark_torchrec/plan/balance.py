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
tolerance keeps the trade small: the phase spends at most that share of the step on balance, and
never trades more. It stops when the ratio is met, when no move lowers the busiest rank's
communication, or when its budget of priced candidates (SearchConfig.balance_evaluations) is spent;
a plan already within the ratio is left as it is, unpriced.
"""

from __future__ import annotations

import numpy as np

from .cost import StepCost
from .moves import cell_moves, cells_on, confinement, heaviest_tables, light_ranks, recuts, reshapes, swaps
from .objective import Objective, better
from .report import Progress
from .search_state import Changes, Move, SearchState


def comm_imbalance(step: StepCost) -> float:
    """The busiest rank's embedding communication (intra + inter-node ms) over the average rank's; 1.0 with none."""
    comm = step.rank_intra_ms + step.rank_inter_ms
    mean = float(comm.mean())
    return float(comm.max()) / mean if mean > 0 else 1.0


def comm_spread(step: StepCost) -> Objective:
    """What the phase lowers: the busiest rank's communication, then the sum of squared per-rank communication."""
    comm = step.rank_intra_ms + step.rank_inter_ms
    return float(comm.max()), float(np.dot(comm, comm))


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

    def run(self, state: SearchState) -> None:
        config = state.config
        step = state.cost.step_cost(state.total)
        if comm_imbalance(step) <= config.comm_balance:
            return
        start = state.priced
        limit = step.step_ms * (1.0 + config.balance_tolerance)
        current = comm_spread(step)
        while state.priced - start < config.balance_evaluations and comm_imbalance(step) > config.comm_balance:
            if self.progress is not None:
                note = f"busiest / average communication {comm_imbalance(step):.2f}"
                self.progress("balancing", state.priced - start, config.balance_evaluations, note)
            best: tuple[Objective, Move] | None = None
            for change in self._candidates(state, step):
                move = state.evaluate(change)
                if move is None or move.step.step_ms > limit:
                    continue
                spread = comm_spread(move.step)
                if best is None or better(spread, best[0]):
                    best = (spread, move)
            if best is None or not better(best[0], current):
                break
            current, move = best
            state.apply(move)
            step = move.step
            self.moves += 1
        self.evaluations = state.priced - start
