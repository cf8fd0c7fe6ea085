"""EMBark's 3D search (PlanSearch runs its four phases in order): a greedy split-and-place (phase 1) and a polish
(phase 2) in phases.py, then an improvement (phase 3) and a balance (phase 4).

The phases are strategies over one SearchState (state.py), the plan under search: phase 1
(SplitRounds) leaves its best placement there, phase 2 (Polish) and phase 3 (improve.Improvement)
price their moves against it and apply the ones they take. Clusters come before (clusters.py): they
decide which tables the state holds as movable.

Phase 3, improve (improve.py): a hill climb priced exactly, move by move, on the tables that load
the bottleneck ranks most: cell moves and cuts, swaps of one-cell tables, re-splits (a slice more
or fewer, twice or half as many, placed again), re-cuts into many more slices at once, spreads (and
re-splits) of the heaviest tables of every rank on the busiest-by-communication (by-lookups)
plateau in one move, confinement to the fewest nodes, re-clustering (RB, UB, DP, where the
table's constraints allow), emptying whole sharding groups and moving tables into another group
together (their collectives), the best move of each round taken while it lowers the step; at a
local optimum, seeded random kicks restart the climb from the best plan; then the smallest tables are made
data-parallel in batches, and the climb runs again from each. It stops when its budget of priced
candidates (SearchConfig.improve_budget) is spent, so it never makes the greedy plan worse and
costs a fixed amount of work whatever the model. The greedy phases fix each table's cluster and
shape early from estimates; phase 3 undoes what they got wrong (on DCNv2 at 64 GPUs, row splits whose
partial sums cost more than they balance: about 15% of the step). Phase 4, balance (balance.py): where the
busiest rank's communication is over SearchConfig.comm_balance times the average rank's, moves of that
rank's tables that lower it, within SearchConfig.balance_tolerance of phase 3's step; if the ratio is
still over, hierarchical tables' column slices sent from the busiest nodes to others, kept when they
reach it. bound.py gives a lower bound on the step of any plan, which the report compares the plan with.

Ties on step time are broken by the sum of squared per-rank loads (objective.py). Every loop runs in
a fixed order and phase 3's kicks draw from a seeded generator, so the result is deterministic.
"""

from __future__ import annotations

from typing import Mapping

from ..cost.model import CostModel
from ..layout.constraints import TableConstraints
from ..layout.kinds import DATA_PARALLEL_KIND
from ..layout.tables import Plan, TableLayout, WirePrecision
from ..progress import Progress
from .balance import CommBalance
from .config import SearchConfig, SearchStats
from .improve import Improvement
from .phases import Polish, SplitRounds
from .state import SearchState


class PlanSearch:
    """One search for one model, topology and cluster assignment (which phase 3 may change): the
    phases, as strategies over one SearchState, in order."""

    def __init__(
        self,
        cost: CostModel,
        clusters: Mapping[str, str],
        constraints: Mapping[str, TableConstraints],
        config: SearchConfig,
        progress: Progress | None = None,
    ) -> None:
        self.cost = cost
        self.config = config
        self.progress = progress
        self.stats = SearchStats()
        self.state = SearchState(cost, clusters, constraints, config)

    @property
    def layouts(self) -> dict[str, TableLayout]:
        return self.state.layouts

    def run(self) -> Plan:
        state = self.state
        if state.movable:
            for phase in (SplitRounds(self.stats, self.progress), Polish(self.stats, self.progress)):
                phase.run(state)
        else:
            state.set_plan(dict(state.fixed), state.fixed_total.copy())
        self.stats.loads_computed = self.cost.computed
        self.stats.greedy_step_ms = self.cost.step_cost(state.total).step_ms
        if self.progress is not None:
            self.progress("improving", 0, self.config.improve_evaluations, "")
        improvement = Improvement(self.progress)
        improvement.run(state)
        self.stats.improve_moves = improvement.moves
        self.stats.improve_evaluations = improvement.evaluations
        self.stats.improve_kicks = improvement.kicks
        self.stats.improve_batches = improvement.batches
        self.stats.improve_loads_computed = self.cost.computed - self.stats.loads_computed
        balance = CommBalance(self.progress)
        balance.run(state)
        self.stats.balance_moves = balance.moves
        self.stats.balance_evaluations = balance.evaluations
        topo = self.cost.topology
        order = [t.name for t in self.cost.spec.tables]
        allreduce = self.config.precision.get(
            DATA_PARALLEL_KIND.name, WirePrecision()
        ).backward  # DDP's, dense gradients included
        return Plan(topo.world_size, topo.local_world_size, {n: state.layouts[n] for n in order}, {}, allreduce)
