"""The planner's choice of TorchRec's own sharding for fp8 table-wise and column-wise tables (torchrec_fp8.py): each
group of one module, type, precision and row width moves only while the step stays within the tolerance of the
search's, every such group moves at an unbounded tolerance, each moved group is priced as TorchRec's (its own group
of collectives, int64 IDs), and a table whose layout its constraints fix is never moved."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from embark_torchrec.plan.layout.constraints import TableConstraints
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.groups import sharding_group
from embark_torchrec.plan.layout.tables import Plan, TableLayout, WirePrecision
from embark_torchrec.plan.plan_model import EMBARK, plan_model
from embark_torchrec.plan.report import ScoredPlan, render, summary
from embark_torchrec.plan.search.config import SearchConfig
from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology
from embark_torchrec.plan.search.torchrec_fp8 import torchrec_fp8_groups

WS, LWS = 8, 4
FP8 = WirePrecision("fp8", "fp8")
SPEC = ModelSpec(
    "m",
    4096,
    tuple(TableSpec(f"t{i}", rows=1_000_000, dim=16 if i % 2 else 32, pooling=2.0) for i in range(8))
    + (TableSpec("rows", rows=4_000_000, dim=16, pooling=2.0),),
)


def _plan() -> Plan:
    """Table-wise fp8 tables of widths 32 and 16 on every rank, and one row-wise fp8 table (always ours)."""
    tables = {
        f"t{i}": replace(TableLayout.table_wise(1_000_000, 16 if i % 2 else 32, i), precision=FP8) for i in range(8)
    }
    rows = TableLayout("rb", (0, 1_000_000, 2_000_000, 3_000_000, 4_000_000), (0, 16), ((0,), (1,), (2,), (3,)), FP8)
    return Plan(WS, LWS, {**tables, "rows": rows})


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(SPEC, Topology(WS, LWS))


def _groups(plan: Plan) -> set[str]:
    return {sharding_group(plan.tables[t.name], t.rows, WS, LWS).name for t in SPEC.tables}


def test_unbounded_tolerance_moves_every_table_and_column_wise_fp8_table(cost: CostModel) -> None:
    """At math.inf every table-wise fp8 table runs on TorchRec's sharding in a group of its width, the row-wise one
    stays ours; the plan is priced as such (the same as pricing it afresh) and costs more than ours here (two more
    groups of collectives, int64 IDs): the default tolerance would keep ours."""
    plan = _plan()
    step = cost.evaluate(plan)
    moved, moved_step = torchrec_fp8_groups(cost, plan, step, {}, math.inf)
    assert all(moved.tables[f"t{i}"].torchrec_at_fp8 for i in range(8)) and not moved.tables["rows"].torchrec_at_fp8
    assert _groups(moved) == {"table_wise:fp8-fp8@32", "table_wise:fp8-fp8@16", "embark_rb:fp8-fp8"}
    assert moved_step.step_ms == cost.evaluate(moved).step_ms > step.step_ms
    assert torchrec_fp8_groups(cost, plan, step, {}) == (plan, step)


def test_each_width_moves_only_within_the_tolerance(cost: CostModel) -> None:
    """With a tolerance just over what moving the first group (in sharding-type order: width 16) costs, that group
    moves and the second, which would pass the cap, does not; just under it, neither moves."""
    plan, step = _plan(), cost.evaluate(_plan())
    narrow = replace(
        plan,
        tables={n: replace(x, torchrec_at_fp8=x.col_bounds == (0, 16) and n != "rows") for n, x in plan.tables.items()},
    )
    share = cost.evaluate(narrow).step_ms / step.step_ms - 1.0
    assert share > 0
    moved, moved_step = torchrec_fp8_groups(cost, plan, step, {}, share * 1.001)
    assert _groups(moved) == {"table_wise:fp8-fp8@16", "embark_rb:fp8-fp8"}
    assert moved_step.step_ms <= step.step_ms * (1 + share * 1.001)
    assert torchrec_fp8_groups(cost, plan, step, {}, share * 0.999)[0] == plan


def test_a_fixed_layout_is_never_moved(cost: CostModel) -> None:
    """A table whose constraints fix its layout keeps it, even at an unbounded tolerance."""
    plan = _plan()
    fixed = {"t0": TableConstraints(layout=plan.tables["t0"])}
    moved, _ = torchrec_fp8_groups(cost, plan, cost.evaluate(plan), fixed, math.inf)
    assert not moved.tables["t0"].torchrec_at_fp8 and moved.tables["t2"].torchrec_at_fp8
    assert sharding_group(moved.tables["t2"], 1_000_000, WS, LWS).torchrec_type == "table_wise"


def test_plan_model_applies_the_search_configs_tolerance() -> None:
    """plan_model runs the choice after the search with SearchConfig.torchrec_fp8_tolerance: on tables of one width
    (32 table-wise at dim 64, 16 ranks), 0 keeps every table on ours, math.inf moves every one onto TorchRec's
    sharding for a small priced cost (the same collectives, as ours then has no table left; int64 IDs)."""
    spec = ModelSpec(
        "one_width",
        65536,
        tuple(TableSpec(f"t{i}", rows=200_000 * (1 + i % 3), dim=64, pooling=1.0) for i in range(32)),
    )
    planned = {
        tol: plan_model(
            spec,
            Topology(16, 8),
            config=SearchConfig(precision={"rb": FP8, "ub": FP8}, torchrec_fp8_tolerance=tol),
            progress=False,
        )
        for tol in (0.0, math.inf)
    }
    kept, moved = planned[0.0], planned[math.inf]
    assert kept.source == moved.source == EMBARK
    assert all(x.fp8_builtin_type() is not None for x in moved.plan.tables.values())
    assert not any(x.torchrec_at_fp8 for x in kept.plan.tables.values())
    assert all(x.torchrec_at_fp8 for x in moved.plan.tables.values())
    assert kept.cost.step_ms < moved.cost.step_ms < kept.cost.step_ms * 1.01


def test_a_sequence_tables_column_wise_layout_is_never_moved() -> None:
    """TorchRec's EmbeddingCollection runs no column-wise sharding: at an unbounded tolerance a sequence table's
    table-wise fp8 layout moves and its column-wise one stays ours."""
    spec = ModelSpec(
        "seq",
        4096,
        (
            TableSpec("tw", rows=100_000, dim=32, pooling=4.0, kind="sequence"),
            TableSpec("cw", rows=100_000, dim=32, pooling=4.0, kind="sequence"),
        ),
    )
    plan = Plan(
        WS,
        LWS,
        {
            "tw": replace(TableLayout.table_wise(100_000, 32, 1), precision=FP8),
            "cw": TableLayout("rb", (0, 100_000), (0, 16, 32), ((2, 3),), FP8),
        },
    ).with_kinds(spec)
    cost = CostModel(spec, Topology(WS, LWS))
    moved, _ = torchrec_fp8_groups(cost, plan, cost.evaluate(plan), {}, math.inf)
    assert moved.tables["tw"].torchrec_at_fp8 and not moved.tables["cw"].torchrec_at_fp8
    moved.validate(spec)


def test_the_report_counts_the_tables_on_torchrecs_sharding_at_fp8(cost: CostModel) -> None:
    """The report's summary and text say how many fp8 tables the plan puts on TorchRec's own sharding (none: no
    mention)."""
    plan = _plan()
    moved, step = torchrec_fp8_groups(cost, plan, cost.evaluate(plan), {}, math.inf)
    scored = ScoredPlan("embark", moved, step, None)
    assert summary(scored)["torchrec_at_fp8_tables"] == 8
    assert "8 fp8 tables on TorchRec's own sharding" in render([scored], cost.topology, "m")
    kept = ScoredPlan("embark", plan, cost.evaluate(plan), None)
    assert summary(kept)["torchrec_at_fp8_tables"] == 0 and "TorchRec's own sharding" not in render(
        [kept], cost.topology, "m"
    )
