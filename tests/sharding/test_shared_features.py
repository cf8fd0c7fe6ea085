"""A feature read by several tables (TorchRec's shared features) trains exactly on every sharding type.

TorchRec names such a feature's outputs "feature@table" and looks it up once per table. One model here has three
features each read by two or three tables, on our grid, hierarchical grid and unique-based types and on TorchRec's
table-wise, row-wise and data-parallel: sharded training equals an unsharded EmbeddingBagCollection (outputs under
TorchRec's names, weights after two steps) at 2 ranks and 4 ranks as 2 nodes x 2, for sum, mean and weighted pooling;
and an ID valid in one of a feature's tables but not another is refused naming the smaller table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout import TableLayout
from embark_torchrec.sharding.validation import InvalidIdError
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import compare_sharded_training, sharded_model

pytestmark = pytest.mark.torchrec_version

ATOL = 1e-5
STEPS = 2
WORLDS = {2: 2, 4: 2}
# name -> (rows, dim, features, {world size: layout}); f0, f1 and f2 are each read by two or three tables
TABLES: dict[str, tuple[int, int, list[str], dict[int, TableLayout]]] = {
    "grid": (
        40,
        16,
        ["f0", "f1"],
        {
            2: TableLayout("rb", (0, 13, 40), (0, 8, 16), ((0, 1), (1, 0))),
            4: TableLayout("rb", (0, 13, 40), (0, 8, 16), ((0, 1), (3, 2))),
        },
    ),
    "ub": (
        24,
        8,
        ["f0", "f2"],
        {
            2: TableLayout("ub", (0, 12, 24), (0, 4, 8), ((1, 0), (0, 1))),
            4: TableLayout("ub", (0, 12, 24), (0, 4, 8), ((3, 0), (0, 2))),
        },
    ),
    "hier": (
        36,
        8,
        ["f2"],
        {
            2: TableLayout("rb", (0, 20, 36), (0, 4, 8), ((1, 0), (0, 1)), hierarchical=True),
            4: TableLayout("rb", (0, 20, 36), (0, 4, 8), ((1, 2), (3, 0)), hierarchical=True),
        },
    ),
    "tw": (20, 12, ["f1", "f2"], {ws: TableLayout.table_wise(20, 12, ws - 1) for ws in WORLDS}),
    "rw": (
        31,
        8,
        ["f0"],
        {
            ws: TableLayout(
                "rb", tuple(min(i * -(-31 // ws), 31) for i in range(ws + 1)), (0, 8), tuple((k,) for k in range(ws))
            )
            for ws in WORLDS
        },
    ),
    "dp": (10, 4, ["f1"], {ws: TableLayout.data_parallel() for ws in WORLDS}),
}
CONFIGS = [("sum", "sgd"), ("mean", "adagrad"), ("weighted", "sgd")]


def _tables(ws: int, pooling: str) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    """The model; under "mean", every table pools by MEAN, TorchRec's row-wise too, whose MEAN fix-up divides per
    feature: f0 also feeds the grid and UB tables, which must not be divided again."""
    configs = [
        EmbeddingBagConfig(
            name=name,
            num_embeddings=rows,
            embedding_dim=dim,
            feature_names=list(features),
            pooling=PoolingType.MEAN if pooling == "mean" else PoolingType.SUM,
        )
        for name, (rows, dim, features, _) in TABLES.items()
    ]
    return configs, {name: spec[3][ws] for name, spec in TABLES.items()}


def _run(lws: int) -> dict[str, Any]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    for pooling, optimizer in CONFIGS:
        tables, layouts = _tables(ws, pooling)
        out[pooling] = compare_sharded_training(
            tables, layouts, lws, steps=STEPS, optimizer=optimizer, weighted=pooling == "weighted", seed=ws
        )
    tables, layouts = _tables(ws, "sum")
    model = sharded_model(tables, layouts, lws)
    # f1 feeds "dp" (10 rows) and "grid" (40): ID 12 is a row of grid but not of dp
    keys = ["f0", "f1", "f2"]
    bad = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor([1, 12, 3]), lengths=torch.tensor([1, 1, 1])
    )
    try:
        model(bad)
        out["bad_id"] = None
    except InvalidIdError as e:
        out["bad_id"] = str(e)
    dist.barrier()
    out["rank"] = rank
    return out


@pytest.fixture(scope="module", params=sorted(WORLDS))
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ws = request.param
    return ws, run_ranks(_run, ws, local_world_size=WORLDS[ws], timeout_s=400, args=(WORLDS[ws],))


@pytest.mark.parametrize("pooling", [c[0] for c in CONFIGS])
def test_shared_features_train_like_unsharded(results: tuple[int, list[dict[str, Any]]], pooling: str) -> None:
    ws, per_rank = results
    tables, _ = _tables(ws, pooling)
    names = [n for per_table in get_embedding_names_by_table(tables) for n in per_table]
    assert "f0@grid" in names and "f0@ub" in names and "f1@dp" in names  # the model does share features
    expected = {f"step{s}/{n}" for s in range(STEPS) for n in names} | {
        f"weight/ebc.embedding_bags.{t.name}.weight" for t in tables
    }
    for rank, result in enumerate(per_rank):
        diffs = result[pooling]
        assert set(diffs) == expected, (rank, sorted(set(diffs) ^ expected))
        worst = {k: v for k, v in diffs.items() if v > ATOL}
        assert not worst, (ws, rank, pooling, worst)


def test_shared_feature_id_checked_against_each_table(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for result in per_rank:
        message = result["bad_id"]
        assert message is not None and "'f1'" in message and "'dp'" in message and "[0, 10)" in message, message
