"""Phase 4 of the search (plan/balance.py): where the climb leaves the busiest rank's communication far above the
average rank's, it comes down, within the step tolerance; a plan already within the ratio is left as it is."""

from __future__ import annotations

import dataclasses
import math

from embark_torchrec.plan.balance import CommBalance, comm_imbalance
from embark_torchrec.plan.clusters import assign_clusters
from embark_torchrec.plan.cost import CostModel
from embark_torchrec.plan.search import GreedySearch, SearchConfig
from embark_torchrec.plan.spec import builtin_model
from embark_torchrec.plan.topology import PRESETS, Topology


def test_the_busiest_rank_s_communication_comes_down_within_the_step_tolerance() -> None:
    """DCNv2 at 128 GPUs: the climb's plan (phase 4 off) has its busiest rank over 1.10x the average rank's
    communication; phase 4 lowers the busiest rank's communication and the ratio, with the step within
    balance_tolerance of the climb's; run again with the ratio set above what it reached, it prices nothing and
    changes nothing."""
    spec = builtin_model("dcnv2").with_batch_size(65536)
    cost = CostModel(spec, Topology(128, 8, PRESETS["dgx-h100"]))
    off = SearchConfig(comm_balance=math.inf)
    search = GreedySearch(cost, assign_clusters(cost, {}, off.dp_memory_fraction), {}, off)
    search.run()
    state = search.state
    climbed = cost.step_cost(state.total)
    state.config = SearchConfig()
    assert comm_imbalance(climbed) > state.config.comm_balance

    balance = CommBalance()
    balance.run(state)
    balanced = cost.step_cost(state.total)
    assert balance.moves > 0 and 0 < balance.evaluations <= state.config.balance_evaluations
    assert balanced.comm_ms < climbed.comm_ms
    assert comm_imbalance(balanced) < comm_imbalance(climbed)
    assert balanced.step_ms <= climbed.step_ms * (1 + state.config.balance_tolerance)

    layouts = dict(state.layouts)
    state.config = dataclasses.replace(state.config, comm_balance=comm_imbalance(balanced))
    again = CommBalance()
    again.run(state)
    assert again.evaluations == 0 and state.layouts == layouts
