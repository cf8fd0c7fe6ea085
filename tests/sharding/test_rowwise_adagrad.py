"""Row-wise Adagrad (fused EXACT_ROWWISE_ADAGRAD) on every layout whose per-row state TorchRec can hold.

Each cell keeps one accumulator per row over its own columns, as TorchRec's column-wise sharding does; the reference
is an unsharded EmbeddingBagCollection trained by RowwiseAdagrad with the same column slices. Properties:
- sharded training equals the reference (outputs, weights after two steps), for tables cut by rows alone (several
  cells of one table on one rank, hierarchical, unique-based), by columns alone (several cells on one rank), TorchRec's
  table-wise and column-wise, and data-parallel, at 2 ranks and 4 as 2 nodes x 2;
- the fused optimizer's state_dict tiles the global row-wise state (one row per table row and column slice) with the
  cells' accumulators exactly once, and a DCP save / load round trip restores them bit for bit;
- a row x column grid, whose per-row state TorchRec's fused optimizer cannot lay out, is refused by name at
  construction, before any collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import compare_sharded_training, sharded_model

pytestmark = pytest.mark.torchrec_version

ATOL = 1e-5
WORLDS = {2: 2, 4: 2}
# name -> (rows, dim, {world size: layout})
TABLES: dict[str, tuple[int, int, dict[int, TableLayout]]] = {
    "rows_multi": (
        33,
        16,
        {ws: TableLayout("rb", (0, 7, 20, 33), (0, 16), ((0,), (ws - 1,), (0,))) for ws in WORLDS},
    ),
    "cols_multi": (
        30,
        16,
        {ws: TableLayout("rb", (0, 30), (0, 4, 8, 16), ((1, 0, 1),)) for ws in WORLDS},
    ),
    "hier": (
        36,
        8,
        {
            2: TableLayout("rb", (0, 20, 36), (0, 8), ((1,), (0,)), hierarchical=True),
            4: TableLayout("rb", (0, 20, 36), (0, 8), ((1,), (2,)), hierarchical=True),
        },
    ),
    "ub": (
        24,
        8,
        {ws: TableLayout("ub", (0, 5, 12, 24), (0, 8), ((0,), (ws - 1,), (0,))) for ws in WORLDS},
    ),
    "tw": (20, 12, {ws: TableLayout.table_wise(20, 12, ws - 1) for ws in WORLDS}),
    "cw": (
        18,
        16,
        {2: TableLayout("rb", (0, 18), (0, 8, 16), ((1, 0),)), 4: TableLayout("rb", (0, 18), (0, 8, 16), ((2, 3),))},
    ),
    "dp": (10, 4, {ws: TableLayout.data_parallel() for ws in WORLDS}),
}


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=[f"{name}_f"])
        for name, (rows, dim, _) in TABLES.items()
    ]


Pieces = list[tuple[list[int], list[int], torch.Tensor]]


def _momentum(model: torch.nn.Module) -> dict[str, tuple[list[int], Pieces]]:
    """Per table: the global size of the fused optimizer's row-wise state and this rank's pieces of it
    (offsets, sizes, values)."""
    out: dict[str, tuple[list[int], Pieces]] = {}
    for state in model.fused_optimizer.state_dict()["state"].values():
        for key, value in state.items():
            if key.endswith(".momentum1"):
                pieces = [
                    (list(s.metadata.shard_offsets), list(s.metadata.shard_sizes), s.tensor.clone())
                    for s in value.local_shards()
                ]
                out[key.split(".")[0]] = (list(value.size()), pieces)
    return out


def _run(lws: int, directory: str) -> dict[str, Any]:
    ws = dist.get_world_size()
    tables = _tables()
    layouts = {name: spec[2][ws] for name, spec in TABLES.items()}
    out: dict[str, Any] = {
        "training": compare_sharded_training(tables, layouts, lws, steps=2, optimizer="rowwise_adagrad", seed=ws)
    }
    model = sharded_model(tables, layouts, lws, optimizer="rowwise_adagrad")
    from embark_torchrec.testing.batches import global_kjt_batch

    for step in range(2):
        batch = global_kjt_batch(tables, ws, 4, seed=50 + step)[dist.get_rank()]
        loss = sum(v.sum() for v in model(batch).to_dict().values())
        loss.backward()
    before = _momentum(model)
    dcp.save(model.fused_optimizer.state_dict(), checkpoint_id=directory)
    fresh = sharded_model(tables, layouts, lws, optimizer="rowwise_adagrad")
    state = fresh.fused_optimizer.state_dict()
    dcp.load(state, checkpoint_id=directory)
    fresh.fused_optimizer.load_state_dict(state)
    out["momentum"], out["reloaded"] = before, _momentum(fresh)
    grid = dict(layouts, rows_multi=TableLayout("rb", (0, 7, 20, 33), (0, 8, 16), ((0, 0), (ws - 1, 0), (0, 1))))
    try:
        sharded_model(tables, grid, lws, optimizer="rowwise_adagrad")
        out["grid_error"] = None
    except ValueError as e:
        out["grid_error"] = str(e)
    return out


@pytest.fixture(scope="module", params=sorted(WORLDS))
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[Any]]:
    ws = request.param
    directory = str(tmp_path_factory.mktemp(f"rowwise{ws}"))
    return ws, run_ranks(_run, ws, local_world_size=WORLDS[ws], timeout_s=400, args=(WORLDS[ws], directory))


def test_rowwise_adagrad_trains_like_unsharded(results: tuple[int, list[Any]]) -> None:
    ws, per_rank = results
    for rank, result in enumerate(per_rank):
        diffs = result["training"]
        assert {f"weight/ebc.embedding_bags.{t}.weight" for t in TABLES} <= set(diffs)
        worst = {k: v for k, v in diffs.items() if v > ATOL}
        assert not worst, (ws, rank, worst)


def test_rowwise_state_is_laid_out_per_cell_and_survives_dcp(results: tuple[int, list[Any]]) -> None:
    """Every model-parallel table's global row-wise state has one row per (row, column slice); the ranks' pieces
    tile it exactly once; DCP restores every piece bit for bit."""
    ws, per_rank = results
    for name, (rows, _, per_world) in TABLES.items():
        layout = per_world[ws]
        if layout.cluster == "dp":
            continue
        slices = len(layout.col_bounds) - 1
        covered: list[tuple[int, int]] = []
        for result in per_rank:
            if name not in result["momentum"]:  # TorchRec's table-wise: only its rank holds state
                continue
            size, pieces = result["momentum"][name]
            assert size == [rows * slices], (name, size)
            covered += [(off[0], off[0] + sz[0]) for off, sz, _ in pieces]
            reloaded = result["reloaded"][name][1]
            assert len(reloaded) == len(pieces), name
            for (off, sz, value), (off2, sz2, value2) in zip(pieces, reloaded):
                assert (off, sz) == (off2, sz2) and torch.equal(value, value2), name
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == rows * slices, (name, covered)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (name, covered)


def test_row_by_column_grid_is_refused_by_name(results: tuple[int, list[Any]]) -> None:
    _, per_rank = results
    for result in per_rank:
        message = result["grid_error"]
        assert message is not None and "'rows_multi'" in message and "3 x 2" in message, message


def test_planner_cuts_rows_or_columns_for_rowwise_optimizers() -> None:
    """Large, busy tables at 16 ranks become row x column grids under SGD; under row-wise Adagrad the same model is
    cut one way only, so DistributedModelParallel can build it."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from embark_torchrec import EmbarkEmbeddingBagCollectionSharder, EmbarkPlanner

    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=2_000_000, embedding_dim=256, feature_names=[f"f{i}"])
        for i in range(2)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    constraints = {t.name: ParameterConstraints(pooling_factors=[50.0]) for t in tables}
    shapes = {}
    for optimizer in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD):
        planner = EmbarkPlanner(
            world_size=16, local_world_size=8, hardware="dgx-h100", batch_size=4096, constraints=constraints
        )
        planner.plan(ebc, [EmbarkEmbeddingBagCollectionSharder(fused_params={"optimizer": optimizer})])
        layouts = planner.plans[""].plan.tables.values()
        shapes[optimizer.name] = [(layout.num_row_slices, layout.num_col_slices) for layout in layouts]
    assert any(r > 1 and c > 1 for r, c in shapes["EXACT_SGD"]), shapes  # the model does call for grids
    assert all(r == 1 or c == 1 for r, c in shapes["EXACT_ROWWISE_ADAGRAD"]), shapes


def test_planner_sees_row_wise_optimizers_applied_in_backward() -> None:
    """An optimizer given to the parameters by apply_optimizer_in_backward (as dlrm_main.py does) counts like the
    sharder's fused one: TorchRec's RowWiseAdagrad makes the planner cut one way only."""
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from embark_torchrec import EmbarkEmbeddingBagCollectionSharder, EmbarkPlanner

    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=2_000_000, embedding_dim=256, feature_names=[f"f{i}"])
        for i in range(2)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    planner = EmbarkPlanner(
        world_size=16,
        local_world_size=8,
        hardware="dgx-h100",
        batch_size=4096,
        constraints={t.name: ParameterConstraints(pooling_factors=[50.0]) for t in tables},
    )
    planner.plan(ebc, [EmbarkEmbeddingBagCollectionSharder()])
    shapes = [(layout.num_row_slices, layout.num_col_slices) for layout in planner.plans[""].plan.tables.values()]
    assert all(r == 1 or c == 1 for r, c in shapes), shapes
