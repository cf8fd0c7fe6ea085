"""Sharding groups: the collectives the cost model charges per group are the ones the runtime issues.

For each sharding type (TorchRec's table-wise, column-wise, row-wise, table-row-wise, data-parallel; our flat and
hierarchical RB grids and UB), 4 gloo ranks (2 nodes x 2, one spawn for all cases) train one step of a model whose
tables all run in that group, and count every c10d collective the step dispatches (DDP's included); a model with
tables in three groups, and one with a data-parallel table beside a table-wise one, must issue the sum of their
groups' and one split exchange for the module. The count must equal groups.module_collectives_per_step, and the
cost model must charge exactly group_ms for each distinct group, whatever the number of tables in it.
"""

from __future__ import annotations

from typing import Any, Mapping

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.kinds import UNIQUE_COLLECTIVES
from embark_torchrec.plan.layout.groups import (
    INPUT_EXCHANGE_COLLECTIVES,
    ShardingGroup,
    module_collectives_per_step,
    sharding_group,
)
from embark_torchrec.plan.layout.tables import Plan, TableLayout
from embark_torchrec.plan.layout.torchrec_types import FLAT_COLLECTIVES, HIERARCHICAL_COLLECTIVES
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import PRESETS, Topology
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.training import sharded_model
from tests.support import toy

WS, LWS, BATCH = 4, 2, 4
ROWS, DIM = 40, 8
# per sharding type: the layout of each of two tables
LAYOUTS: dict[str, tuple[TableLayout, TableLayout]] = {
    "table_wise": (TableLayout.table_wise(ROWS, DIM, 1), TableLayout.table_wise(ROWS, DIM, 2)),
    "column_wise": (TableLayout("rb", (0, ROWS), (0, 4, 8), ((0, 3),)),) * 2,
    "row_wise": (TableLayout("rb", (0, 10, 20, 30, 40), (0, DIM), ((0,), (1,), (2,), (3,))),) * 2,
    "table_row_wise": (TableLayout("rb", (0, 20, 40), (0, DIM), ((2,), (3,)), hierarchical=True),) * 2,
    "embark_rb": (TableLayout("rb", (0, 15, 40), (0, 4, 8), ((0, 1), (3, 2))),) * 2,
    "embark_rb_hier": (TableLayout("rb", (0, 15, 40), (0, 4, 8), ((0, 1), (2, 3)), hierarchical=True),) * 2,
    "embark_ub": (TableLayout.table_wise(ROWS, DIM, 0, "ub"), TableLayout("ub", (0, 25, 40), (0, DIM), ((1,), (3,)))),
    "data_parallel": (TableLayout.data_parallel(),) * 2,
}
TABLES = toy.equal_tables(EmbeddingBagConfig, 2, ROWS, DIM)
MIXED_TABLES = toy.equal_tables(EmbeddingBagConfig, 3, ROWS, DIM)
MIXED_LAYOUTS = {"t0": LAYOUTS["table_wise"][0], "t1": LAYOUTS["embark_ub"][1], "t2": LAYOUTS["embark_rb_hier"][0]}


CASES: dict[str, tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]] = {
    **{kind: (TABLES, dict(zip(("t0", "t1"), pair))) for kind, pair in LAYOUTS.items()},
    "mixed": (MIXED_TABLES, MIXED_LAYOUTS),
    "with_data_parallel": (TABLES, {"t0": LAYOUTS["table_wise"][0], "t1": LAYOUTS["data_parallel"][0]}),
}


class _CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives dispatched: those torch.distributed's functions issue and those DDP's
    reducer issues from C++ (a data-parallel group's gradient all-reduce), which no Python wrapper sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += func.namespace == "c10d"
        return func(*args, **(kwargs or {}))


def _count_collectives() -> dict[str, int]:
    """On each rank: the collectives of the second training step of each case (the first step builds the lazily
    created dists)."""
    result = {}
    for case, (tables, layouts) in CASES.items():
        model = sharded_model(tables, layouts, LWS)
        for step in range(2):
            kjt = global_kjt_batch(tables, WS, BATCH, seed=step)[dist.get_rank()]
            with _CollectiveCounter() as counter:
                out = model(kjt)
                out = (out.wait() if hasattr(out, "wait") else out).to_dict()
                torch.cat(list(out.values()), dim=1).sum().backward()
            result[case] = counter.calls
    return result


@pytest.fixture(scope="module")
def counted() -> list[dict[str, int]]:
    return run_ranks(_count_collectives, WS, local_world_size=LWS, timeout_s=300)


def _expected(tables: list[EmbeddingBagConfig], layouts: Mapping[str, TableLayout]) -> int:
    return module_collectives_per_step(sharding_group(layouts[t.name], t.num_embeddings, WS, LWS) for t in tables)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_group_issues_the_collectives_it_is_charged(counted: list[dict[str, int]], kind: str) -> None:
    """A module of one group issues the group's collectives and its split exchange (a data-parallel group alone:
    its DDP all-reduce and the exchange, which carries the batch's input check to every rank)."""
    tables, layouts = CASES[kind]
    assert {sharding_group(layouts[t.name], ROWS, WS, LWS).name for t in tables} == {kind}
    charged = ShardingGroup.parse(kind).collectives_per_step + INPUT_EXCHANGE_COLLECTIVES
    assert [c[kind] for c in counted] == [charged] * WS


def test_groups_add_up(counted: list[dict[str, int]]) -> None:
    """Tables in several groups of one module: the step issues the sum of the groups' collectives and one split
    exchange, however many groups share it."""
    mixed = FLAT_COLLECTIVES + UNIQUE_COLLECTIVES + HIERARCHICAL_COLLECTIVES + INPUT_EXCHANGE_COLLECTIVES
    assert [c["mixed"] for c in counted] == [_expected(*CASES["mixed"])] * WS == [mixed] * WS == [4 + 4 + 6 + 1] * WS
    with_dp = [c["with_data_parallel"] for c in counted]
    assert with_dp == [_expected(*CASES["with_data_parallel"])] * WS == [4 + 1 + 1] * WS


@pytest.mark.parametrize("case", sorted(CASES))
def test_cost_model_charges_what_runs(counted: list[dict[str, int]], case: str) -> None:
    """The cost model's collectives for each case's plan are the ones its step issued (its groups' and the module's
    split exchange), each priced at the topology's collective_us (on cpu-gloo's shared host, at this world size)."""
    tables, layouts = CASES[case]
    topology = Topology(WS, LWS, PRESETS["cpu-gloo"])
    specs = tuple(TableSpec(t.name, t.num_embeddings, t.embedding_dim, 1.0, tuple(t.feature_names)) for t in tables)
    step = CostModel(ModelSpec("m", WS * BATCH, specs), topology).evaluate(Plan(WS, LWS, dict(layouts)))
    assert [step.collective_ms] * WS == pytest.approx([c[case] * topology.collective_us / 1e3 for c in counted])


def test_cost_model_charges_each_distinct_group_once() -> None:
    """Each distinct group adds its own collectives to the plan's, once, whatever the number of tables in it."""
    spec = ModelSpec("m", WS * 8, tuple(TableSpec(f"t{i}", ROWS, DIM, 2.0) for i in range(3)))
    cost = CostModel(spec, Topology(WS, LWS, PRESETS["cpu-gloo"]))
    price = cost.topology.collective_us / 1e3

    def collective_ms(layouts: Mapping[str, TableLayout]) -> float:
        return cost.evaluate(Plan(WS, LWS, dict(layouts))).collective_ms

    tw = {f"t{i}": TableLayout.table_wise(ROWS, DIM, i) for i in range(3)}
    one_group = collective_ms(tw)
    assert one_group > 0
    dp_group = ShardingGroup.parse("data_parallel").collectives_per_step * price  # its own DDP's all-reduce
    assert collective_ms({**tw, "t2": TableLayout.data_parallel()}) == pytest.approx(one_group + dp_group)
    mixed = {**tw, "t1": LAYOUTS["embark_ub"][0], "t2": LAYOUTS["embark_rb_hier"][0]}
    assert collective_ms(mixed) == pytest.approx(one_group + (4 + 6) * price)
    step = cost.evaluate(Plan(WS, LWS, mixed))
    assert step.step_ms == pytest.approx(
        step.lookup_ms + step.comm_ms + step.collective_ms + step.dp_allreduce_ms + step.dense_ms
    )
    free = CostModel(
        spec, Topology(WS, LWS, PRESETS["cpu-gloo"].with_overrides(collective_us=0.0, oversubscribed_collective_us=0.0))
    )
    assert free.evaluate(Plan(WS, LWS, mixed)).collective_ms == 0.0


def _groups(plan: Plan, spec: ModelSpec) -> set[str]:
    return {sharding_group(plan[t.name], t.rows, plan.world_size, plan.local_world_size).name for t in spec.tables}


def test_costly_collectives_keep_the_plan_in_one_group() -> None:
    """With free collectives the planner mixes clusters and shapes (several groups); once a group's collectives
    cost more than any table's traffic, the plan runs in a single sharding group."""
    tables = tuple(
        TableSpec(f"t{i}", rows, 32, pooling, id_distribution=IdDistribution("zipf", 1.1))
        for i, (rows, pooling) in enumerate(
            [(1_000, 1.0), (2_000, 2.0), (50_000, 6.0), (100_000, 12.0), (100_000, 20.0)]
        )
    )
    spec = ModelSpec("m", 8 * 256, tables)
    free = PRESETS["dgx-h100"].with_overrides(collective_us=0.0)
    costly = free.with_overrides(collective_us=1e4)
    assert len(_groups(plan_model(spec, Topology(8, 4, free)).plan, spec)) > 1
    planned = plan_model(spec, Topology(8, 4, costly))
    assert len(_groups(planned.plan, spec)) == 1
