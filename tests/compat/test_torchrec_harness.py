"""TorchRec's own sharding test harness, run with our sharder and planner: our sharder passes wherever TorchRec's own
EmbeddingBagCollectionSharder passes.

Configurations (compat_driver.py): TorchRec's TestSparseNN with its test tables (an EBC whose feature_0 and
feature_1 feed two tables each, and a weighted EBC), gloo on CPU, 2 ranks (one node) and 4 ranks (2 nodes x 2); plans
forcing each of TorchRec's built-in sharding types (and mixes of them) through ParameterConstraints, hand-built
layouts on our grid / hierarchical / unique-based types, TorchRec's and EmbarkPlanner's own plans; options: sum or
mean pooling, a variable batch per feature (VBE) or per rank, fp16 QCommsConfig, fused SGD, EXACT_ADAGRAD or
EXACT_ROWWISE_ADAGRAD. Each runs with ours and with TorchRec's own sharder (where it can run the plan), checked by
TorchRec's harness itself (SGD) and by our driver (two steps; loss, predictions, dense gradients, every weight, and
the fused optimizer's state as its state_dict gives it).

All cases of a world size run in one spawned group of ranks (run_ranks), once, for the cases selected; each test
reads its case's outcome, so a failure names the configuration: test_embark_sharder[ws4-grid_shared-vbe].

Where TorchRec's own sharder fails here (its code, on CPU/gloo), the configuration is outside the acceptance: the
TorchRec-side test asserts it still fails (when a TorchRec upgrade fixes one, that test fails and the configuration
becomes one ours must pass), and ours is skipped there unless it passes anyway (then it must keep passing).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from tests.compat.compat_driver import (
    BUILTIN_TYPES,
    CONSTRAINED,
    EXAMPLE_PLANS,
    MIXED_TYPES,
    PLANS,
    NOT_RUNNABLE,
    OPTIONS,
    PLANNER_PLANS,
    WORLDS,
    Case,
    Outcome,
    expected_checks,
    run_cases,
)
from embark_torchrec.testing import run_ranks

pytestmark = pytest.mark.torchrec_version

RUN_TIMEOUT_S = 420.0

# ---------------------------------------------------------------- the matrix

#: options per world size; at 4 ranks (time budget) two whose code paths do not depend on nodes are left out:
#: element-wise Adagrad (state laid out like the weights) and a variable batch per rank (an input-dist matter)
OPTIONS_AT = {2: OPTIONS, 4: ("sum", "mean", "vbe", "qcomms", "rowwise")}


def _checks(world: int, option: str) -> tuple[str, ...]:
    """Both checks at 2 ranks; at 4 ranks TorchRec's harness for the SGD options and our driver for the optimizers
    (the suite's time budget; the harness's predictions after its step depend on every weight too)."""
    if world == 2:
        return ("harness", "driver")
    return ("driver",) if option in ("adagrad", "rowwise") else ("harness",)


#: plans only some options are run with: TorchRec's examples' constraint patterns with what they are about (a
#: replicated table trains; grid_shard trains under SGD and is refused under row-wise Adagrad; unique-based and
#: TorchRec's types mixed, and the unique-based layouts forced, pass under VBE with constraints for all 8 of the
#: harness's tables, two of which the VBE model lacks)
PLAN_OPTIONS = {
    "rw_tw": ("sum", "mean"),
    "dense_kernel": ("sum", "adagrad"),
    "grid_planned": ("sum", "rowwise"),
    "ub_mixed": ("sum", "vbe"),
    "ub_planned": ("vbe",),
}
#: plans left out at 4 ranks: there TorchRec's planner and ours with the CPU preset place tables whole (table-wise
#: or data-parallel), as the forced single-type plans already do; ub_planned runs the layouts "ub" runs there
SKIPPED_AT = {2: (), 4: ("torchrec_planner", "embark_planner", "ub_planned")}
TORCHREC_RUNS = set(BUILTIN_TYPES) | set(CONSTRAINED) | set(PLANNER_PLANS)  # plans of built-in types (maybe)

_RW_BATCH = "its row-wise reduce-scatter (row_wise, table_row_wise, grid_shard) has gloo all-gather unequal batches"
_DP_VBE = "data_parallel tables run TorchRec's dense CPU kernel, which ignores a variable batch per feature"
_VB_RS = "its variable-batch reduce-scatter has gloo all-gather unequal sizes"
_MEAN = "its MEAN fix-up for row-wise tables divides the other tables' outputs by their bag lengths too"
#: (plan, option) -> why TorchRec's own sharder fails there on CPU/gloo (both world sizes)
TORCHREC_FAILS = {
    ("data_parallel", "vbe"): _DP_VBE,
    ("torchrec_planner", "vbe"): _DP_VBE + " (TorchRec's planner replicates some of these tables)",
    ("embark_planner", "vbe"): _DP_VBE + " (ours replicates them all with cpu-gloo's figures)",
    ("mixed", "vbe"): _DP_VBE,
    ("row_wise", "vbe"): _VB_RS,
    ("table_row_wise", "vbe"): _VB_RS,
    ("grid_shard", "vbe"): "IndexError in its variable-batch path (a 1-D tensor indexed in dimension 1)",
    ("row_wise", "vbs"): _RW_BATCH,
    ("table_row_wise", "vbs"): _RW_BATCH,
    ("grid_shard", "vbs"): _RW_BATCH,
    ("mixed", "vbs"): _RW_BATCH,
    ("grid_shard", "mean"): "grid_shard's MEAN-pooled outputs differ from the unsharded model's",
    ("mixed", "mean"): _MEAN,
    ("rw_tw", "mean"): _MEAN,
}
#: world size -> (plan, option) -> why TorchRec's own sharder fails there at that world size only
TORCHREC_FAILS_AT = {
    2: {
        ("embark_planner_h100", "vbe"): _DP_VBE
        + " (at 2 ranks ours replicates two of them: their all-reduce hides behind the backward's lookups)"
    },
}


def _torchrec_fails(case: Case) -> str | None:
    """Why TorchRec's own sharder fails in this configuration (TORCHREC_FAILS, TORCHREC_FAILS_AT), if it does."""
    key = (case.plan, case.option)
    return TORCHREC_FAILS.get(key) or TORCHREC_FAILS_AT.get(case.world_size, {}).get(key)


#: of those, where ours passes all the same (it corrects TorchRec's MEAN fix-up, also for shared features): it must
#: keep passing
OURS_PASS_WHERE_TORCHREC_FAILS = {("mixed", "mean"), ("rw_tw", "mean")}
#: our gaps, strict: each flips to a failure once fixed (shared features, VBE and row-wise Adagrad on grids, and
#: TorchRec's MEAN fix-up on shared features, failed here before and pass now)
GAPS: dict[tuple[str, str], str] = {}
#: our deliberate refusals: a row x column grid under row-wise Adagrad (TorchRec's fused optimizer cannot lay out
#: its per-row state), refused by name when the model is sharded
REFUSALS = {("grid", "rowwise"): r"table 'table_2': a 2 x 2 grid cannot keep exact_row_wise_adagrad's per-row state"}
#: refusals at plan time, on every rank (collective_plan raises rank 0's error everywhere): grid_shard under the
#: RowWiseAdagrad that TorchRec's examples give through apply_optimizer_in_backward
PLAN_REFUSALS = {
    ("grid_planned", "rowwise"): r"PlanError: table 'table_2': its constraints ask for a row x column grid "
    r"\(sharding_types \['grid_shard'\]\), but its optimizer EXACT_ROWWISE_ADAGRAD \(from apply_optimizer_in_backward\)"
}


def _cases() -> list[Case]:
    cases = []
    for world in WORLDS:
        for plan in PLANS:
            for option in OPTIONS_AT[world]:
                if option not in PLAN_OPTIONS.get(plan, OPTIONS) or plan in SKIPPED_AT[world]:
                    continue
                checks = _checks(world, option)
                cases.append(Case(world, plan, option, "embark", checks))
                if plan in TORCHREC_RUNS:
                    cases.append(Case(world, plan, option, "torchrec", checks))
    return cases


CASES = _cases()
OURS = [c for c in CASES if c.sharder == "embark"]
THEIRS = [c for c in CASES if c.sharder == "torchrec"]


def _id(case: Case) -> str:
    return case.name.removesuffix(f"-{case.sharder}")


def _ours(case: Case) -> Any:
    key = (case.plan, case.option)
    if key in GAPS:
        return pytest.param(case, id=_id(case), marks=pytest.mark.xfail(strict=True, reason=GAPS[key]))
    return pytest.param(case, id=_id(case))


# ---------------------------------------------------------------- running the selected cases, once per world size

_RUNS: dict[int, dict[str, list[Outcome]] | BaseException] = {}


def _selected(session: pytest.Session, world: int) -> list[Case]:
    """The cases of this world size that the session's selected tests read (all of them when none is selected)."""
    wanted = []
    for item in session.items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        case = params.get("case")
        if isinstance(case, Case) and case.world_size == world:
            wanted.append(case)
        elif params.get("world") == world:  # test_plans_have_the_layouts_they_name reads our "sum" cases
            wanted += [c for c in OURS if c.world_size == world and c.option == "sum"]
    return list(dict.fromkeys(wanted)) or [c for c in CASES if c.world_size == world]


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """outcomes(case) -> that case's Outcome on every rank, running each world's selected cases on first use."""

    def get(case: Case) -> list[Outcome]:
        world = case.world_size
        if world not in _RUNS:
            cases = _selected(request.session, world)
            progress = tmp_path_factory.mktemp(f"ws{world}") / "current_case"
            try:
                per_rank = run_ranks(
                    run_cases,
                    world,
                    local_world_size=WORLDS[world],
                    timeout_s=RUN_TIMEOUT_S,
                    args=(cases,),
                    kwargs={"progress_path": str(progress)},
                )
                _RUNS[world] = {c.name: [r[c.name] for r in per_rank] for c in cases}
            except Exception as exc:  # noqa: BLE001 - every test of this world reports it
                current = progress.read_text() if progress.exists() else "(none started)"
                _RUNS[world] = RuntimeError(f"the {world}-rank run failed during case {current}: {exc}")
        run = _RUNS[world]
        if isinstance(run, BaseException):
            raise run
        if case.name not in run:
            pytest.fail(f"{case.name} was not run (selected after its world's run started)")
        return run[case.name]

    return get


def _failures(per_rank: list[Outcome]) -> dict[str, str]:
    """check -> the first failing rank's error (first line, then the traceback's end)."""
    out: dict[str, str] = {}
    for rank, outcome in enumerate(per_rank):
        for check, error in outcome.checks.items():
            if error is not None and check not in out:
                first, _, rest = error.partition("\n")
                out[check] = f"rank {rank}: {first}\n{rest[-2500:]}"
    return out


def _summary(failures: dict[str, str]) -> str:
    return "; ".join(f"{check}: {text.splitlines()[0]}" for check, text in failures.items())


def _assert_passes(case: Case, per_rank: list[Outcome]) -> None:
    failures = _failures(per_rank)
    ran = set(per_rank[0].checks)
    assert not failures, f"{case.name} ({per_rank[0].plan_types}):\n" + "\n\n".join(
        f"[{check}] {text}" for check, text in failures.items()
    )
    expected = expected_checks(case)
    assert ran == expected, f"{case.name}: checks run {sorted(ran)}, expected {sorted(expected)}"
    fused = any(kind != "data_parallel" for kind in per_rank[0].plan_types.values())
    if "driver" in ran and case.optimizer != "sgd" and fused:  # the optimizer-state comparison was not vacuous
        assert sum(o.state_shards for o in per_rank) > 0, f"{case.name}: no fused optimizer state was compared"


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", [_ours(c) for c in OURS])
def test_embark_sharder(case: Case, outcomes: Any) -> None:
    """Our sharder, fed the configuration's plan, passes TorchRec's harness check (SGD) and our two-step driver:
    outputs, loss, dense gradients, every weight and the fused optimizer's state equal the unsharded model's at the
    harness's tolerances. Exceptions: a plan ours refuses by design (REFUSALS) must be refused by name, and where
    TorchRec's own sharder fails too (TORCHREC_FAILS) ours is skipped, unless it passes there all the same; a plan
    refused at plan time (PLAN_REFUSALS) must be refused by name on every rank."""
    key = (case.plan, case.option)
    per_rank = outcomes(case)
    if key in PLAN_REFUSALS:
        for rank, outcome in enumerate(per_rank):
            assert set(outcome.checks) == {"plan"}, f"{case.name}: rank {rank} went past planning: {outcome.checks}"
            first = outcome.checks["plan"].splitlines()[0]
            assert first.startswith(f"(rank {rank} planning) "), f"{case.name}: rank {rank} did not raise: {first}"
            assert re.search(PLAN_REFUSALS[key], first), f"{case.name}: rank {rank}: {first}"
        return
    if key in REFUSALS:
        failures = _failures(per_rank)
        assert set(failures) == {"driver"}, f"{case.name}: expected a refusal when sharding, got {failures}"
        first = failures["driver"].splitlines()[0]
        assert re.search("ValueError: " + REFUSALS[key], first), f"{case.name}: {first}"
        return
    torchrec_fails = _torchrec_fails(case)
    if torchrec_fails and key not in OURS_PASS_WHERE_TORCHREC_FAILS and key not in GAPS:
        pytest.skip(
            f"TorchRec's own sharder fails here ({torchrec_fails}); ours: "
            + (_summary(_failures(per_rank)) or "passes")
        )
    _assert_passes(case, per_rank)


@pytest.mark.parametrize("case", [pytest.param(c, id=_id(c)) for c in THEIRS])
def test_torchrec_sharder(case: Case, outcomes: Any) -> None:
    """TorchRec's own EmbeddingBagCollectionSharder on the same plans and inputs: it passes wherever the matrix says
    ours must, and still fails where TORCHREC_FAILS says it does (so the set of configurations ours must pass is
    exactly where TorchRec's own sharder passes)."""
    per_rank = outcomes(case)
    if NOT_RUNNABLE in per_rank[0].checks:
        pytest.skip(f"the plan puts tables on our sharding types: {per_rank[0].plan_types}")
    key = (case.plan, case.option)
    torchrec_fails = _torchrec_fails(case)
    if torchrec_fails:
        failures = _failures(per_rank)
        assert "plan" not in failures, f"{case.name}: planning failed: {failures['plan']}"
        assert failures, (
            f"{case.name}: TorchRec's own sharder now passes ({torchrec_fails} no longer holds): remove "
            f"{key} from TORCHREC_FAILS(_AT) so that ours must pass here too"
        )
        return
    _assert_passes(case, per_rank)


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_plans_have_the_layouts_they_name(world: int, outcomes: Any) -> None:
    """The configurations are not vacuous: each forced built-in type is what the plan holds for every table, the
    hand-built plans put tables on our grid, hierarchical and unique-based types (the shared features' tables too in
    the *_shared plans), EmbarkPlanner with dgx-h100's figures (free collectives and de-duplication) plans our types
    at 4 ranks, and the examples' constraint patterns give what they ask: compute_kernels=["dense"] a replicated table,
    grid_shard a grid, cluster "ub" beside table_wise / column_wise a mix of unique-based and TorchRec's types."""
    from tests.compat.compat_driver import RW_TW_TYPES

    def types(plan: str) -> dict[str, str]:
        return outcomes(Case(world, plan, "sum", "embark"))[0].plan_types

    for kind in BUILTIN_TYPES:
        assert set(types(kind).values()) == {kind}, (kind, types(kind))
    assert types("mixed") == MIXED_TYPES
    assert types("rw_tw") == RW_TW_TYPES
    shared = {"table_0", "table_1", "table_4", "table_5"}
    for plan, ours in {
        "grid": "embark_rb",
        "grid_cuts": "embark_rb",
        "grid_shared": "embark_rb",
        "hier": "embark_rb_hier",
        "ub": "embark_ub",
        "ub_shared": "embark_ub",
    }.items():
        on_ours = {t for t, kind in types(plan).items() if kind == ours}
        assert {"table_2", "table_3", "weighted_table_0"} <= on_ours, (plan, types(plan))
        if plan.endswith("_shared"):
            assert shared <= on_ours, (plan, types(plan))
    assert {"table_4"} <= {t for t, kind in types("hier").items() if kind == "embark_rb_hier"}
    if world == 4:
        assert any(kind.startswith("embark_") for kind in types("embark_planner_h100").values())
    assert types("dense_kernel")["table_2"] == "data_parallel", types("dense_kernel")
    assert types("grid_planned")["table_2"].startswith("embark_rb"), types("grid_planned")  # no built-in type: ours
    mixed = types("ub_mixed")
    assert {mixed["table_2"], mixed["table_3"]} == {"embark_ub"}, mixed
    assert {kind for t, kind in mixed.items() if t not in ("table_2", "table_3")} <= {"table_wise", "column_wise"}
    assert set(EXAMPLE_PLANS) == {"dense_kernel", "grid_planned", "ub_mixed", "ub_planned"}


@pytest.mark.parametrize("plan", ["ub_mixed", "ub_planned"])
def test_vbe_cases_pass_with_constraints_for_tables_the_model_lacks(plan: str, outcomes: Any) -> None:
    """TorchRec's tests give constraints for all 8 of the harness's tables, and under VBE the model has no weighted
    tables: EmbarkPlanner ignores the 2 names the model lacks (as TorchRec's planner does) and the unique-based
    (ub_planned: the hand-built "ub" layouts, which the planner reproduces) and mixed (ub_mixed) cases plan what
    the constraints ask and pass TorchRec's harness and our driver at 2 ranks."""
    case = Case(2, plan, "vbe", "embark")
    per_rank = outcomes(case)
    types = per_rank[0].plan_types
    assert "plan" not in per_rank[0].checks, per_rank[0].checks["plan"]
    assert set(types) < set(MIXED_TYPES) and set(MIXED_TYPES) - set(types) == {"weighted_table_0", "weighted_table_1"}
    assert types["table_2"] == types["table_3"] == "embark_ub", types
    if plan == "ub_planned":
        assert types == outcomes(Case(2, "ub", "vbe", "embark"))[0].plan_types
    _assert_passes(case, per_rank)


def test_harness_needs_only_the_placeholder() -> None:
    """Why the placeholder is enough: the wheel lacks torchrec.distributed.tests, test_sharding.py takes one name
    from it, TestEmbeddingCollectionSharder, and builds it only under `if submodule_configs is not None` (2D parallel,
    never passed here). A TorchRec upgrade that changes any of this fails here, by name."""
    assert importlib.util.find_spec("torchrec.distributed.test_utils") is not None
    assert importlib.util.find_spec("torchrec.distributed.tests") is None
    spec = importlib.util.find_spec("torchrec.distributed.test_utils.test_sharding")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    missing = [
        (node.module, [a.name for a in node.names])
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchrec.distributed.tests")
    ]
    assert missing == [("torchrec.distributed.tests.test_sequence_model", ["TestEmbeddingCollectionSharder"])]
    guarded: list[bool] = []

    def visit(node: ast.AST, under_submodule_configs: bool) -> None:
        if isinstance(node, ast.Name) and node.id == "TestEmbeddingCollectionSharder":
            guarded.append(under_submodule_configs)
        for child in ast.iter_child_nodes(node):
            inside = under_submodule_configs or (
                isinstance(node, ast.If) and "submodule_configs" in ast.unparse(node.test) and child in node.body
            )
            visit(child, inside)

    visit(tree, False)
    assert guarded == [True]
