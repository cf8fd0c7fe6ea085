"""The search's knobs (SearchConfig), which every phase reads, and what the search did (SearchStats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..layout.tables import WirePrecision


@dataclass(frozen=True)
class SearchConfig:
    patience: int = 16  # split rounds past the best plan seen before phase 1 stops
    max_rounds: int = 2000
    polish_moves: int = 200
    placement_candidates: int = 6  # least loaded ranks tried for a cut or moved cell in phase 2
    cells_per_rank: int = 2  # heaviest cells of each costliest rank that phase 2 tries to move
    improve_evaluations: int = 6000  # candidates phase 3 prices before it stops (its work budget)
    improve_tables: int = 4  # tables of each bottleneck rank whose moves phase 3 tries
    improve_targets: int = 4  # least loaded ranks a cell may move to in phase 3 (and one by lookups, one by comm)
    improve_seed: int = 0  # of phase 3's random kicks
    dp_batch_sizes: tuple[int, ...] = (4, 8, 16, 32)  # smallest tables phase 3 makes data-parallel at once, then climbs
    dp_batch_share: float = 1 / 3  # of improve_evaluations, each climb from a DP batch prices at most
    # ranks above which that share shrinks in proportion: a candidate's pricing grows with the ranks, and
    # the batches' climbs would otherwise double the planning time of 1,000 tables on 1,024 ranks
    dp_batch_ranks: int = 128
    plateau_share: float = 0.01  # ranks within this share of the busiest's communication are its plateau
    plateau_ranks: int = 16  # of the plateau, those whose heaviest tables one move of phase 3 spreads at most
    comm_balance: float = 1.10  # busiest / average rank communication above which phase 4 balances it
    balance_tolerance: float = 0.002  # share of the step phase 4's moves of the busiest rank's tables may spend
    balance_evaluations: int = 1000  # candidates those price at most
    # phase 4's exchanges between nodes: the share of the step they may spend, kept only when they bring the
    # ratio within comm_balance; the candidates they price at most; the nodes (of the busiest ranks) they send from
    exchange_tolerance: float = 0.005
    exchange_evaluations: int = 1500
    exchange_nodes: int = 4
    dp_memory_fraction: float = 0.05
    # share of the search's step that moving fp8 table-wise and column-wise tables onto TorchRec's own sharding (one
    # group per row width, torchrec_fp8.py) may spend; 0: only where it is not slower; math.inf: every such table
    torchrec_fp8_tolerance: float = 0.0
    precision: Mapping[str, WirePrecision] = field(default_factory=dict)  # per cluster; default fp32

    @property
    def improve_budget(self) -> int:
        """The most candidates phase 3 prices: its climb's, and each DP batch's climb's (at most ranks)."""
        batch = int(self.improve_evaluations * self.dp_batch_share)
        return self.improve_evaluations + len(self.dp_batch_sizes) * batch


@dataclass
class SearchStats:
    """What the search did. The work counters are what tests/test_plan_scale.py bounds per table and
    round, so that planning stays linear in the tables."""

    rounds: int = 0
    moves: int = 0
    evaluations: int = 0
    initial_step_ms: float = 0.0
    placements: int = 0  # placements of every movable cell (phase 1)
    cells_placed: int = 0
    rank_probes: int = 0  # ranks looked at to place those cells (off the heap, or of a table's nodes)
    tables_summed: int = 0  # per-table loads added into whole-plan totals
    tables_scanned: int = 0  # tables looked at for the costliest table or the heaviest cells of a rank
    loads_computed: int = 0  # per-table loads the cost model computed in full (CostModel.computed) in phases 1-2
    greedy_step_ms: float = 0.0  # after phases 1 and 2
    improve_moves: int = 0  # moves phase 3 took
    improve_evaluations: int = 0  # candidates phase 3 priced: its budget, SearchConfig.improve_budget
    improve_kicks: int = 0  # random restarts of phase 3 from its best plan
    improve_batches: int = 0  # DP batches phase 3 climbed from
    improve_loads_computed: int = 0  # per-table loads computed in full in phase 3
    balance_moves: int = 0  # moves phase 4 took
    balance_evaluations: int = 0  # candidates phase 4 priced
