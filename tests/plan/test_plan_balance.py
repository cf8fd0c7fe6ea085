"""Phase 4 of the search (plan/search/balance.py): where the climb leaves the busiest rank's communication far above the
average rank's, it comes down, within the step tolerance; where that leaves the ratio over, exchanges between
nodes bring it within, or are undone; a plan already within the ratio is left as it is."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from embark_torchrec.plan.search.balance import CommBalance, comm_imbalance
from embark_torchrec.plan.search.clusters import assign_clusters
from embark_torchrec.plan.cost.model import CostModel, StepCost
from embark_torchrec.plan.search.moves import exchanged
from embark_torchrec.plan.search.driver import PlanSearch
from embark_torchrec.plan.search.config import SearchConfig
from embark_torchrec.plan.search.state import SearchState, Snapshot
from embark_torchrec.plan.model.spec import ModelSpec, builtin_model, load_model_spec
from embark_torchrec.plan.model.topology import PRESETS, Topology

Climbed = tuple[SearchState, Snapshot, StepCost]
MODELS = Path(__file__).resolve().parents[2] / "benchmarks" / "models"


def climb(spec: ModelSpec, world_size: int) -> Climbed:
    """`spec` on `world_size` GPUs (8 a node) after the climb (phase 4 off): its state, that plan, its step."""
    cost = CostModel(spec.with_batch_size(65536), Topology(world_size, 8, PRESETS["dgx-h100"]))
    off = SearchConfig(comm_balance=math.inf)
    search = PlanSearch(cost, assign_clusters(cost, {}, off.dp_memory_fraction), {}, off)
    search.run()
    state = search.state
    return state, state.snapshot(), cost.step_cost(state.total)


@pytest.fixture(scope="module")
def climbed() -> Climbed:
    """DCNv2 at 128 GPUs after the climb (phase 4 off)."""
    return climb(builtin_model("dcnv2"), 128)


def balanced(climbed: Climbed, config: SearchConfig) -> tuple[CommBalance, StepCost]:
    """Phase 4 under `config` from the climb's plan: what it did, and the step it left."""
    state, plan, _ = climbed
    state.restore(plan)
    state.config = config
    balance = CommBalance()
    balance.run(state)
    return balance, state.cost.step_cost(state.total)


def test_the_busiest_rank_s_communication_comes_down_within_the_step_tolerance(climbed: Climbed) -> None:
    """The climb's plan has its busiest rank over 1.10x the average rank's communication; phase 4's moves of the
    busiest rank's tables (the exchanges off) lower the busiest rank's communication and the ratio, with the step
    within balance_tolerance of the climb's; run again with the ratio set above what it reached, it prices nothing
    and changes nothing."""
    state, _, before = climbed
    config = SearchConfig(exchange_evaluations=0)
    assert comm_imbalance(before) > config.comm_balance

    balance, after = balanced(climbed, config)
    assert balance.moves > 0 and 0 < balance.evaluations <= config.balance_evaluations
    assert after.comm_ms < before.comm_ms
    assert comm_imbalance(after) < comm_imbalance(before)
    assert after.step_ms <= before.step_ms * (1 + config.balance_tolerance)

    layouts = dict(state.layouts)
    state.config = dataclasses.replace(config, comm_balance=comm_imbalance(after))
    again = CommBalance()
    again.run(state)
    assert again.evaluations == 0 and state.layouts == layouts


def test_exchanges_between_nodes_bring_the_ratio_within_where_single_moves_stop(climbed: Climbed) -> None:
    """The moves of the busiest rank's tables leave DCNv2 at 128 GPUs over the ratio (no one table's move takes a
    column's stage 2 off a node while another of its ranks holds a cell of it); the exchanges of the busiest
    nodes' column slices bring it within comm_balance, here with the step no higher than the climb's (they try
    that limit before exchange_tolerance) and the candidates priced within the two budgets. Where the exchanges'
    budget runs out short of the ratio (150 candidates: one exchange, to 1.1006), the plan goes back to the first
    stage's."""
    state, _, before = climbed
    config = SearchConfig()
    first, single = balanced(climbed, dataclasses.replace(config, exchange_evaluations=0))
    single_layouts = dict(state.layouts)
    assert comm_imbalance(single) > config.comm_balance

    balance, after = balanced(climbed, config)
    assert comm_imbalance(after) <= config.comm_balance
    assert after.step_ms <= before.step_ms
    assert balance.evaluations <= config.balance_evaluations + config.exchange_evaluations

    short, stuck = balanced(climbed, dataclasses.replace(config, exchange_evaluations=150))
    assert short.evaluations > first.evaluations and comm_imbalance(stuck) > config.comm_balance
    assert state.layouts == single_layouts and stuck.step_ms == single.step_ms


def test_an_exchange_of_ranks_moves_their_lookups_and_memory_with_them(climbed: Climbed) -> None:
    """Two ranks of different nodes exchanged whole: each ends with the other's lookup bytes and memory, every
    other rank keeps its own; only where traffic crosses nodes changes."""
    state, plan, _ = climbed
    state.restore(plan)
    lws = state.local_world_size
    a = next(k for k in range(lws) if state.holders[k])
    b = next(k for k in range(lws, 2 * lws) if state.holders[k])
    change = exchanged(state, [(a, b)])
    assert change is not None and {name for name, _ in change} == state.holders[a] | state.holders[b]
    move = state.evaluate(change, decide_hierarchy=False)
    assert move is not None
    perm = np.arange(state.world_size)
    perm[[a, b]] = [b, a]
    np.testing.assert_allclose(move.total.lookup_bytes, state.total.lookup_bytes[perm])
    np.testing.assert_allclose(move.total.memory, state.total.memory[perm])


def test_the_exchanges_do_not_spend_what_the_first_stage_saved() -> None:
    """Where the first stage's moves also shorten the step (skewed DCNv2 at 64 GPUs: 1.416 -> 1.359 ms, the ratio
    still 1.18), the exchanges stay within exchange_tolerance of that shorter step, not of the climb's: phase 4 never
    ends more than that share above the best plan it has seen (they were once allowed the whole gain, 1.409 ms)."""
    skewed = climb(load_model_spec(MODELS / "skewed_dcnv2.json"), 64)
    first, first_stage = balanced(skewed, SearchConfig(exchange_evaluations=0))
    assert first.moves > 0 and first_stage.step_ms < skewed[2].step_ms
    assert comm_imbalance(first_stage) > SearchConfig().comm_balance

    config = SearchConfig()
    _, after = balanced(skewed, config)
    assert after.step_ms <= first_stage.step_ms * (1 + config.exchange_tolerance)
