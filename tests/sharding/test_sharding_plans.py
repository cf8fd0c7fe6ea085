"""Plans from plan_model for the shipped benchmark models (scaled to CPU size) run in DistributedModelParallel and
train exactly like the unsharded model; plan files load into the ShardingPlan DMP takes, and load_plan refuses plans
that do not fit the module with a PlanError naming the problem.

One 4-rank spawn (2 nodes x 2) trains all four models; the load_plan tests need no spawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.plan.model.spec import ModelSpec, builtin_model
from embark_torchrec.planner.load_plan import load_plan
from embark_torchrec.testing import fake_world, run_ranks
from tests.support.scaled import cpu_topology, ebc_tables, scaled_spec
from embark_torchrec.testing.training import compare_sharded_training

pytestmark = pytest.mark.torchrec_version

WORLD_SIZE, LOCAL_WORLD_SIZE = 4, 2
MODELS = ("dcnv2", "t180", "t200", "t510")
MAX_TABLES = 24  # of the T-models (dcnv2 keeps its 26)
OPTIMIZER = {"dcnv2": "sgd", "t180": "adagrad", "t200": "sgd", "t510": "adagrad"}
ATOL = 1e-5


# ---------------------------------------------------------------- the scaled models and their plans


def _plan_for(name: str) -> tuple[ModelSpec, list[EmbeddingBagConfig], Plan]:
    spec = scaled_spec(builtin_model(name), max_tables=None if name == "dcnv2" else MAX_TABLES)
    planned = plan_model(spec, cpu_topology(spec, WORLD_SIZE, LOCAL_WORLD_SIZE, memory_share=0.5))
    return spec, ebc_tables(spec), planned.plan


@pytest.fixture(scope="module")
def planned() -> dict[str, tuple[ModelSpec, list[EmbeddingBagConfig], Plan]]:
    return {name: _plan_for(name) for name in MODELS}


def _kind(layout: TableLayout, rows: int) -> str:
    """The sharding-type string module_sharding_plan gives the layout."""
    return layout.kind.builtin_sharding_type(layout, rows, WORLD_SIZE, LOCAL_WORLD_SIZE) or (
        "embark_" + layout.cluster + ("_hier" if layout.hierarchical else "")
    )


def test_scaled_specs_keep_the_models_variety(planned: dict[str, Any]) -> None:
    """The CPU-size specs are small (<= 4000 rows, widths multiples of 4, <= 24 tables for the T-models) but keep
    more than one width and several pooling factors (hotness) wherever the full model has them."""
    for name, (spec, tables, _) in planned.items():
        full = builtin_model(name)
        assert len(spec.tables) == (len(full.tables) if name == "dcnv2" else MAX_TABLES), name
        assert all(t.rows <= 4000 and t.dim % 4 == 0 and t.dim >= 4 for t in spec.tables), name
        full_dims, dims = {t.dim for t in full.tables}, {t.dim for t in spec.tables}
        assert len(dims) == len(full_dims), (name, full_dims, dims)
        full_pool, pool = {t.pooling for t in full.tables}, {t.pooling for t in spec.tables}
        assert len(pool) >= min(4, len(full_pool)), (name, full_pool, pool)
        assert {t.pooling for t in tables} == {PoolingType.SUM, PoolingType.MEAN}, name


def test_scaled_plans_split_tables(planned: dict[str, Any]) -> None:
    """Under the small memory cap the planner does not just place tables whole: every model's plan row-splits at
    least one table, and together the plans use grids (rows x columns), hierarchical row splits, flat row splits
    on our grid sharding, and data-parallel tables, so the training test below is not vacuous."""
    kinds: set[str] = set()
    grids = 0
    for name, (spec, _, plan) in planned.items():
        layouts = {t.name: plan[t.name] for t in spec.tables}
        assert any(lay.cluster != "dp" and lay.num_row_slices > 1 for lay in layouts.values()), (name, layouts)
        for t in spec.tables:
            layout = layouts[t.name]
            kinds.add(_kind(layout, t.rows))
            grids += layout.cluster != "dp" and layout.num_row_slices > 1 and layout.num_col_slices > 1
    assert {"embark_rb", "embark_rb_hier", "data_parallel", "table_wise"} <= kinds, kinds
    assert grids >= 1


def _train_models(cases: list[tuple[str, list[EmbeddingBagConfig], dict[str, TableLayout], str]]) -> dict[str, Any]:
    return {
        name: compare_sharded_training(tables, layouts, LOCAL_WORLD_SIZE, steps=1, optimizer=opt, silent_rank=None)
        for name, tables, layouts, opt in cases
    }


@pytest.fixture(scope="module")
def trained(planned: dict[str, Any]) -> list[dict[str, dict[str, float]]]:
    cases = [(name, tables, dict(plan.tables), OPTIMIZER[name]) for name, (_, tables, plan) in planned.items()]
    return run_ranks(_train_models, WORLD_SIZE, local_world_size=LOCAL_WORLD_SIZE, timeout_s=400, args=(cases,))


@pytest.mark.parametrize("name", MODELS)
def test_planned_model_trains_like_unsharded(
    name: str, planned: dict[str, Any], trained: list[dict[str, dict[str, float]]]
) -> None:
    """One fused-optimizer step of the model sharded by its plan (4 ranks as 2 nodes x 2) gives the unsharded
    model's pooled output for every feature on every rank, and its weights after the step, within 1e-5."""
    _, tables, _ = planned[name]
    features = {f for t in tables for f in t.feature_names}
    for rank, result in enumerate(trained):
        diffs = result[name]
        assert {k.split("/", 1)[1] for k in diffs if k.startswith("step0/")} == features, (rank, name)
        assert {k for k in diffs if k.startswith("weight/")} == {
            f"weight/ebc.embedding_bags.{t.name}.weight" for t in tables
        }
        bad = {k: v for k, v in diffs.items() if not v <= ATOL}
        assert not bad, (rank, name, bad)


# ---------------------------------------------------------------- load_plan (no spawn)

SMALL = [
    EmbeddingBagConfig(name="grid", num_embeddings=40, embedding_dim=16, feature_names=["g0", "g1"]),
    EmbeddingBagConfig(name="hier", num_embeddings=30, embedding_dim=8, feature_names=["h"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="tw", num_embeddings=20, embedding_dim=12, feature_names=["t"]),
    EmbeddingBagConfig(name="cw", num_embeddings=10, embedding_dim=16, feature_names=["c"]),
    EmbeddingBagConfig(name="dp", num_embeddings=6, embedding_dim=4, feature_names=["d"]),
]
SMALL_PLAN = Plan(
    WORLD_SIZE,
    LOCAL_WORLD_SIZE,
    {
        "grid": TableLayout("rb", (0, 13, 40), (0, 8, 16), ((0, 1), (3, 0))),
        "hier": TableLayout("rb", (0, 10, 30), (0, 8), ((1,), (2,)), hierarchical=True),
        "tw": TableLayout.table_wise(20, 12, 3),
        "cw": TableLayout("rb", (0, 10), (0, 4, 16), ((2, 0),)),
        "dp": TableLayout.data_parallel(),
    },
)


class _Model(nn.Module):
    """The collection two levels down, so plans are addressed by a nested path ("sparse.ebc")."""

    def __init__(self, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.sparse = nn.Module()
        self.sparse.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.dense = nn.Linear(4, 4, device="meta")


def _expected(plan: Plan, tables: list[EmbeddingBagConfig]) -> ShardingPlan:
    spec = ModelSpec.from_module(EmbeddingBagCollection(tables=tables, device=torch.device("meta")), batch_size=4)
    return ShardingPlan({"sparse.ebc": module_sharding_plan(plan, spec, "cpu")})


@pytest.mark.parametrize("source", ["file", "dict", "plan"])
def test_saved_plan_loads_into_the_module_sharding_plan(tmp_path: Path, source: str) -> None:
    """A plan saved by Plan.save (or given as its dict or as the Plan) loads into exactly the ShardingPlan that
    module_sharding_plan builds, under the collection's module path, with every sharding type and shard kept."""
    path = tmp_path / "plan.json"
    SMALL_PLAN.save(path)
    given = {"file": str(path), "dict": SMALL_PLAN.to_dict(), "plan": SMALL_PLAN}[source]
    loaded = load_plan(given, _Model(SMALL), world_size=WORLD_SIZE, compute_device="cpu")
    expected = _expected(SMALL_PLAN, SMALL)
    assert loaded.plan == expected.plan
    # not vacuous: the expected plan has our grid types and torchrec's own
    types = {ps.sharding_type for ps in expected.plan["sparse.ebc"].values()}
    assert types == {"embark_rb", "embark_rb_hier", "table_wise", "column_wise", "data_parallel"}


def test_benchmark_plan_file_loads_into_the_module_sharding_plan(tmp_path: Path, planned: dict[str, Any]) -> None:
    """The same for a planner-made plan of a scaled benchmark model, with the world size taken from the
    initialised process group (a fake one of 4 ranks)."""
    spec, tables, plan = planned["t510"]
    path = tmp_path / "t510.json"
    plan.save(path)
    with fake_world(WORLD_SIZE, rank=1, local_world_size=LOCAL_WORLD_SIZE):
        loaded = load_plan(path, _Model(tables), compute_device="cpu")
    assert loaded.plan == _expected(plan, tables).plan
    assert len(loaded.plan["sparse.ebc"]) == len(spec.tables)


def _without(name: str) -> list[EmbeddingBagConfig]:
    return [t for t in SMALL if t.name != name]


def _resized(name: str, rows: int = 0, dim: int = 0) -> list[EmbeddingBagConfig]:
    out = []
    for t in SMALL:
        if t.name == name:
            t = EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings + rows,
                embedding_dim=t.embedding_dim + dim,
                feature_names=list(t.feature_names),
                pooling=t.pooling,
            )
        out.append(t)
    return out


REFUSALS = {
    "wrong_world_size": (SMALL, 2, r"world size 4.*2 ranks"),
    "table_the_module_lacks": (_without("tw"), WORLD_SIZE, r"lays out tables \['tw'\] that the module does not have"),
    "module_table_missing_from_plan": (
        SMALL + [EmbeddingBagConfig(name="extra", num_embeddings=5, embedding_dim=4, feature_names=["x"])],
        WORLD_SIZE,
        r"no layout for tables \['extra'\]",
    ),
    "row_mismatch": (
        _resized("grid", rows=1),
        WORLD_SIZE,
        r"table 'grid'.*row bounds \[0, 13, 40\] do not cover \[0, 41\)",
    ),
    "dim_mismatch": (
        _resized("cw", dim=4),
        WORLD_SIZE,
        r"table 'cw'.*column bounds \[0, 4, 16\] do not cover \[0, 20\)",
    ),
    "fewer_rows": (_resized("hier", rows=-2), WORLD_SIZE, r"table 'hier'.*row bounds"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_load_plan_refuses_mismatches(case: str, tmp_path: Path) -> None:
    """load_plan refuses a plan that does not fit the module with a PlanError naming the problem: a world size
    other than the job's, a table the module lacks, a module table the plan lacks, rows or widths that differ."""
    tables, world_size, message = REFUSALS[case]
    path = tmp_path / "plan.json"
    SMALL_PLAN.save(path)
    with pytest.raises(PlanError, match=message):
        load_plan(path, _Model(tables), world_size=world_size, compute_device="cpu")


@pytest.mark.parametrize(
    "precision, allreduce, field, words",
    [
        (WirePrecision("fp32", "fp8"), "fp32", "precision.backward", "data-parallel gradients at fp8"),
        (WirePrecision("fp32", "fp16"), "fp32", "precision.backward", "allreduce_precision fp32"),
        (WirePrecision("fp8", "fp16"), "fp16", "precision.forward", "runs at fp32, not fp8"),
    ],
)
def test_load_plan_refuses_a_data_parallel_precision_that_would_not_run_by_table_and_field(
    tmp_path: Path, precision: WirePrecision, allreduce: str, field: str, words: str
) -> None:
    """A plan file's data-parallel table at fp8 (or at another precision than the plan's all-reduce) was accepted
    and trained at fp32 without a word: the example passed a precision string to the DDP wrapper, so the per-table
    check never ran. load_plan, the path every plan file takes, refuses it naming the file, table and field."""
    layouts = {**SMALL_PLAN.tables, "dp": TableLayout.data_parallel(precision)}
    path = tmp_path / "plan.json"
    Plan(SMALL_PLAN.world_size, SMALL_PLAN.local_world_size, layouts, {}, allreduce).save(path)
    with pytest.raises(PlanError) as raised:
        load_plan(path, _Model(SMALL), world_size=WORLD_SIZE, compute_device="cpu")
    message = str(raised.value)
    assert message.startswith(f"{path}: table 'dp': field '{field}': ") and words in message, message


def _load_plan_calls(tmp_path: Path, rows: int, cols: int) -> int:
    """The Python calls load_plan makes for a hand-made plan of one table cut into rows x cols cells."""
    import cProfile
    import pstats

    # cells taller than wide: torch's sweep line then runs along the rows, comparing each cell with its whole row
    table = EmbeddingBagConfig(name="wide", num_embeddings=rows * 8, embedding_dim=cols * 4, feature_names=["w"])
    ranks = tuple(tuple(r * cols + c for c in range(cols)) for r in range(rows))
    layout = TableLayout("rb", tuple(range(0, rows * 8 + 1, 8)), tuple(range(0, cols * 4 + 1, 4)), ranks)
    path = tmp_path / f"plan_{rows}x{cols}.json"
    Plan(rows * cols, cols, {"wide": layout}).save(path)
    profile = cProfile.Profile()
    sharding = profile.runcall(
        load_plan, path, _Model([table]), world_size=rows * cols, compute_device="cpu", local_world_size=cols
    )
    assert len(sharding.plan["sparse.ebc"]["wide"].sharding_spec.shards) == rows * cols
    return int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]


def test_load_plan_is_linear_in_cells(tmp_path: Path) -> None:
    """A hand-made plan's load grows linearly with its cells: four times the cells of a row take at most 5x the
    Python calls (counted, so a loaded machine cannot blur it). It was quadratic (100,000 cells in 100 x 1,000 took
    128 s), as torch's EnumerableShardingSpec compared each cell with its whole row."""
    small, large = _load_plan_calls(tmp_path, 5, 200), _load_plan_calls(tmp_path, 5, 800)
    assert large <= 5 * small, f"load_plan made {small} Python calls for 1,000 cells and {large} for 4,000"


def test_load_plan_refuses_the_wrong_process_group_size() -> None:
    """Without world_size, the initialised process group's size is checked: a 4-rank plan in a 2-rank job fails."""
    with fake_world(2):
        with pytest.raises(PlanError, match=r"world size 4.*2 ranks"):
            load_plan(SMALL_PLAN, _Model(SMALL), compute_device="cpu")
