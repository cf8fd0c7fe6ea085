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
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.sharding.validation import InvalidIdError
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import sharded_model
from tests.support import toy

pytestmark = pytest.mark.torchrec_version

ATOL = 1e-5
STEPS = 2
WORLDS = {2: 2, 4: 2}
# f0, f1 and f2 are each read by two or three tables
TABLES = {
    "grid": toy.Table(40, 16, ["f0", "f1"], {ws: toy.grid(ws) for ws in WORLDS}),
    "ub": toy.Table(24, 8, ["f0", "f2"], {ws: toy.unique(ws) for ws in WORLDS}),
    "hier": toy.Table(36, 8, ["f2"], {ws: toy.hierarchical_grid(ws) for ws in WORLDS}),
    "tw": toy.Table(20, 12, ["f1", "f2"], {ws: TableLayout.table_wise(20, 12, ws - 1) for ws in WORLDS}),
    "rw": toy.Table(31, 8, ["f0"], {ws: toy.row_wise(31, 8, ws) for ws in WORLDS}),
    "dp": toy.Table(10, 4, ["f1"], {ws: TableLayout.data_parallel() for ws in WORLDS}),
}
# under "mean" TorchRec's row-wise pools by MEAN too, whose fix-up divides per feature: f0 also feeds the grid and UB
# tables, which must not be divided again
CONFIGS = [("sum", "sgd"), ("mean", "adagrad"), ("weighted", "sgd")]


def _run(lws: int) -> dict[str, Any]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = dict(toy.train_each_pooling(TABLES, CONFIGS, lws, STEPS, seed=ws))
    tables, layouts = toy.ebc_tables(TABLES, ws, "sum")
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
    tables, _ = toy.ebc_tables(TABLES, ws, pooling)
    names = [n for per_table in get_embedding_names_by_table(tables) for n in per_table]
    assert "f0@grid" in names and "f0@ub" in names and "f1@dp" in names  # the model does share features
    toy.assert_trained_like_unsharded([result[pooling] for result in per_rank], tables, STEPS, ATOL, (ws, pooling))


def test_shared_feature_id_checked_against_each_table(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for result in per_rank:
        message = result["bad_id"]
        assert message is not None and "'f1'" in message and "'dp'" in message and "[0, 10)" in message, message
