"""TorchRec's ParameterConstraints, honoured by EmbarkPlanner as TorchRec's planner reads them.

sharding_types restrict a table to the layouts those types stand for (a list without table_wise asks for cuts: a
row_wise-only table is cut by rows, a column_wise-only one by columns, grid_shard alone both ways, and no row x column
grid unless grid_shard is listed); min_partition bounds the column slices' width; compute_kernels must list a kernel
the plans run (else a named error); pooling_factors x num_poolings at batch_sizes per feature set the table's load.
"""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embark_torchrec import EmbarkEmbeddingBagCollectionSharder, EmbarkPlanner
from embark_torchrec.plan.layout import PlanError
from embark_torchrec.plan.spec import ModelSpec, SpecError

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
