"""TorchRec's ParameterConstraints, honoured by EmbarkPlanner as TorchRec's planner reads them.

sharding_types restrict a table to the layouts those types stand for (a list without table_wise asks for cuts: a
row_wise-only table is cut by rows, a column_wise-only one by columns, grid_shard alone both ways, and no row x column
grid unless grid_shard is listed); min_partition bounds the column slices' width; compute_kernels must list a kernel
the plans run (else a named error), and dense alone replicates the table; pooling_factors x num_poolings at
batch_sizes per feature set the table's load; a plain dict is refused, and so is grid_shard under a row-wise optimizer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embark_torchrec import EmbarkEmbeddingBagCollectionSharder, EmbarkPlanner
from embark_torchrec.plan.layout.tables import PlanError
from embark_torchrec.plan.model.spec import ModelSpec, SpecError

TYPES = {
    "t_rw": ["row_wise"],
    "t_cw": ["column_wise"],
    "t_tw": ["table_wise"],
    "t_grid": ["grid_shard"],
    "t_rw_cw": ["row_wise", "column_wise"],
}


def _ebc(names: list[str], rows: int = 200_000, dim: int = 128) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=dim, feature_names=[f"{n}_f"]) for n in names
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _plan(
    constraints: dict[str, ParameterConstraints], names: list[str], **kw: int
) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    planner = EmbarkPlanner(
        world_size=8, local_world_size=4, hardware="dgx-h100", batch_size=2048, constraints=constraints
    )
    planner.plan(_ebc(names, **kw), [EmbarkEmbeddingBagCollectionSharder()])
    layouts = planner.plans[""].plan.tables
    return {n: (lay.num_row_slices, lay.num_col_slices, lay.col_bounds) for n, lay in layouts.items()}


def test_sharding_types_restrict_the_layouts() -> None:
    busy = [50.0]  # heavy enough that the search wants to cut every table
    constraints = {n: ParameterConstraints(sharding_types=t, pooling_factors=busy) for n, t in TYPES.items()}
    shapes = _plan(constraints, list(TYPES))
    assert shapes["t_rw"][0] >= 2 and shapes["t_rw"][1] == 1, shapes["t_rw"]
    assert shapes["t_cw"][0] == 1 and shapes["t_cw"][1] >= 2, shapes["t_cw"]
    assert shapes["t_tw"][:2] == (1, 1), shapes["t_tw"]
    assert shapes["t_grid"][0] >= 2 and shapes["t_grid"][1] >= 2, shapes["t_grid"]
    assert shapes["t_rw_cw"][0] == 1 or shapes["t_rw_cw"][1] == 1, shapes["t_rw_cw"]


def test_min_partition_bounds_column_widths() -> None:
    constraints = {"t": ParameterConstraints(sharding_types=["column_wise"], min_partition=64, pooling_factors=[50.0])}
    rows, cols, bounds = _plan(constraints, ["t"])["t"]
    assert cols == 2 and all(b - a >= 64 for a, b in zip(bounds, bounds[1:])), bounds
    with pytest.raises(PlanError, match="'t'.*at least 1 x 2"):
        _plan({"t": ParameterConstraints(sharding_types=["column_wise"], min_partition=100)}, ["t"])


def test_compute_kernels_we_cannot_run_are_refused_by_name() -> None:
    with pytest.raises(SpecError, match="table 't'.*compute_kernels.*fused_uvm_caching"):
        _plan({"t": ParameterConstraints(compute_kernels=["fused_uvm_caching"])}, ["t"])
    shapes = _plan({"t": ParameterConstraints(compute_kernels=["fused_uvm_caching", "fused"])}, ["t"])
    assert "t" in shapes


def test_poolings_and_batch_sizes_set_the_load() -> None:
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=8, feature_names=["a", "b"])],
        device=torch.device("meta"),
    )
    c = {"t": ParameterConstraints(pooling_factors=[2.0, 4.0], num_poolings=[1.0, 3.0], batch_sizes=[64, 32])}
    spec = ModelSpec.from_module(ebc, c, batch_size=128, rank_batch_size=64)
    # feature a: 2 IDs x 1 pooling for all 64 samples; b: 4 x 3 for 32 of 64 samples -> (2 + 6) / 2 features
    assert spec.tables[0].pooling == pytest.approx(4.0)
    with pytest.raises(SpecError, match="table 't'.*num_poolings"):
        ModelSpec.from_module(ebc, {"t": ParameterConstraints(num_poolings=[1.0, 2.0, 3.0])}, rank_batch_size=64)


def test_dense_kernel_alone_replicates_the_table() -> None:
    """compute_kernels=["dense"] is how TorchRec's train_dlrm_data_parallel.py makes a table data-parallel (TorchRec's
    dense kernel runs data-parallel tables only): the table is replicated where the free plan shards it; dense with
    sharding types that leave data_parallel out is a contradiction, refused by name."""
    names = ["t_dense", "t_free"]
    free = EmbarkPlanner(world_size=8, local_world_size=4, hardware="dgx-h100", batch_size=2048)
    free.plan(_ebc(names), [EmbarkEmbeddingBagCollectionSharder()])
    assert free.plans[""].plan.tables["t_dense"].cluster != "dp"  # otherwise vacuous
    planner = EmbarkPlanner(
        world_size=8,
        local_world_size=4,
        hardware="dgx-h100",
        batch_size=2048,
        constraints={"t_dense": ParameterConstraints(compute_kernels=["dense"])},
    )
    plan = planner.plan(_ebc(names), [EmbarkEmbeddingBagCollectionSharder()])
    assert plan.plan[""]["t_dense"].sharding_type == "data_parallel"
    assert plan.plan[""]["t_dense"].compute_kernel == "dense"
    assert planner.plans[""].plan.tables["t_free"].cluster != "dp"
    with pytest.raises(SpecError, match="table 't'.*compute_kernels.*dense kernel runs data-parallel tables only"):
        _plan({"t": ParameterConstraints(compute_kernels=["dense"], sharding_types=["row_wise"])}, ["t"])


def test_plain_dicts_are_refused_by_name() -> None:
    """A plain dict in place of a ParameterConstraints (whose fields TorchRec's planner reads as attributes) is
    refused naming the table, even when its keys look right, rather than read as no constraint at all."""
    with pytest.raises(SpecError, match="table 't'.*plain dict.*ParameterConstraints"):
        EmbarkPlanner(world_size=2, constraints={"t": {"sharding_types": ["bogus_type"]}})
    with pytest.raises(SpecError, match="table 't'.*plain dict"):
        EmbarkPlanner(world_size=2, constraints={"t": {"sharding_types": ["table_wise"]}})


def _grid_plan(world: int, dim: int = 64, **kw: Any) -> Any:
    planner = EmbarkPlanner(
        world_size=world,
        local_world_size=min(world, 2),
        compute_device="cpu",
        constraints={"t_grid": ParameterConstraints(sharding_types=["grid_shard"])},
        **kw,
    )
    planner.plan(_ebc(["t_grid", "t_other"], rows=1000, dim=dim), [EmbarkEmbeddingBagCollectionSharder()])
    return planner.plans[""].plan.tables["t_grid"]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_grid_shard_asks_for_slices_not_ranks(world: int) -> None:
    """grid_shard alone asks for at least 2 x 2 slices, at any world size: cells of a table may share a rank (as
    TorchRec's grid_shard does on a node), so 2 ranks plan a grid as 4 and 8 do; only when the cells must share ranks
    and the columns cut unevenly (a rank holds one width of a table) is it refused, by name."""
    layout = _grid_plan(world)
    assert layout.num_row_slices >= 2 and layout.num_col_slices >= 2, layout
    assert set(layout.used_ranks()) <= set(range(world))
    if world < 4:
        with pytest.raises(PlanError, match="'t_grid'.*2 x 2 slices.*dim 20 cuts into columns \\[8, 12\\]"):
            _grid_plan(world, dim=20)
    else:
        assert _grid_plan(world, dim=20).num_col_slices >= 2


def test_grid_shard_under_a_rowwise_optimizer_is_refused_at_plan_time() -> None:
    """grid_shard with a row-wise Adagrad (given in backward, as TorchRec's examples do, or as the sharder's fused
    optimizer) is a contradiction TorchRec's fused optimizer cannot lay out: refused when planning, naming the table,
    the optimizer and what to change, not later inside DistributedModelParallel; other tables of such a model are
    still planned, cut one way only."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    ebc = _ebc(["t_grid", "t_other"], rows=1000, dim=64)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    grid = {"t_grid": ParameterConstraints(sharding_types=["grid_shard"])}
    planner = EmbarkPlanner(world_size=4, local_world_size=2, compute_device="cpu", constraints=grid)
    with pytest.raises(
        PlanError, match="table 't_grid'.*grid_shard.*EXACT_ROWWISE_ADAGRAD.*apply_optimizer_in_backward"
    ):
        planner.plan(ebc, [EmbarkEmbeddingBagCollectionSharder()])
    fused = EmbarkEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    with pytest.raises(PlanError, match="table 't_grid'.*EXACT_ROWWISE_ADAGRAD.*fused_params.*'row_wise'"):
        EmbarkPlanner(world_size=4, local_world_size=2, compute_device="cpu", constraints=grid).plan(
            _ebc(["t_grid", "t_other"], rows=1000, dim=64), [fused]
        )
    rows_only = {"t_grid": ParameterConstraints(sharding_types=["grid_shard", "row_wise"])}
    planner = EmbarkPlanner(world_size=4, local_world_size=2, compute_device="cpu", constraints=rows_only)
    planner.plan(ebc, [EmbarkEmbeddingBagCollectionSharder()])
    layout = planner.plans[""].plan.tables["t_grid"]
    assert layout.num_row_slices >= 2 and layout.num_col_slices == 1, layout
