"""Variable batch per feature (TorchRec's VBE input) trains exactly on our sharding types and TorchRec's.

Each rank's KeyedJaggedTensor gives feature f only B_f bags plus inverse indices over them, as TorchRec's EBC takes
it. On our grid, hierarchical grid and unique-based types, next to TorchRec's table-wise and column-wise
(fused kernels; on CPU/gloo TorchRec's data-parallel ignores VBE, and its row-wise fails in backward, where gloo's
all_gather takes no unequal sizes), sharded training equals an unsharded
EmbeddingBagCollection fed the same VBE batches (outputs and weights after two steps), at 2 ranks and 4 as 2 nodes x 2,
for sum, mean and weighted pooling, with a feature read by two tables.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from embark_torchrec.plan.layout import TableLayout
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import compare_sharded_training

pytestmark = pytest.mark.torchrec_version

ATOL = 1e-5
STEPS = 2
WORLDS = {2: 2, 4: 2}
TABLES: dict[str, tuple[int, int, list[str], dict[int, TableLayout]]] = {
    "grid": (
        40,
        16,
        ["f0", "f1"],
        {
            2: TableLayout("rb", (0, 13, 40), (0, 4, 16), ((0, 1), (1, 0))),
            4: TableLayout("rb", (0, 13, 40), (0, 4, 16), ((0, 1), (3, 2))),
        },
    ),
    "ub": (
        24,
        8,
        ["f2"],
        {
            2: TableLayout("ub", (0, 12, 24), (0, 4, 8), ((1, 0), (0, 1))),
            4: TableLayout("ub", (0, 12, 24), (0, 4, 8), ((3, 0), (0, 2))),
        },
    ),
    "hier": (
        36,
        12,
        ["f0", "f3"],
        {
            2: TableLayout("rb", (0, 20, 36), (0, 4, 12), ((1, 0), (0, 1)), hierarchical=True),
            4: TableLayout("rb", (0, 20, 36), (0, 4, 12), ((1, 2), (3, 0)), hierarchical=True),
        },
    ),
    "tw": (20, 12, ["f4"], {ws: TableLayout.table_wise(20, 12, ws - 1) for ws in WORLDS}),
    "cw": (
        18,
        16,
        ["f5"],
        {2: TableLayout("rb", (0, 18), (0, 8, 16), ((1, 0),)), 4: TableLayout("rb", (0, 18), (0, 8, 16), ((2, 3),))},
    ),
}
CONFIGS = [("sum", "sgd"), ("mean", "sgd"), ("weighted", "sgd")]  # fbgemm's VBE TBE takes no EXACT_ADAGRAD


def _tables(ws: int, pooling: str) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    """Under "mean" every table pools by MEAN."""
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
    ws = dist.get_world_size()
    out: dict[str, Any] = {}
    for pooling, optimizer in CONFIGS:
        tables, layouts = _tables(ws, pooling)
        out[pooling] = compare_sharded_training(
            tables,
            layouts,
            lws,
            steps=STEPS,
            optimizer=optimizer,
            weighted=pooling == "weighted",
            seed=ws + 7,
            variable_batch=True,
        )
    return out


@pytest.fixture(scope="module", params=sorted(WORLDS))
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ws = request.param
    return ws, run_ranks(_run, ws, local_world_size=WORLDS[ws], timeout_s=400, args=(WORLDS[ws],))


@pytest.mark.parametrize("pooling", [c[0] for c in CONFIGS])
def test_variable_batch_trains_like_unsharded(results: tuple[int, list[dict[str, Any]]], pooling: str) -> None:
    ws, per_rank = results
    tables, _ = _tables(ws, pooling)
    names = [n for per_table in get_embedding_names_by_table(tables) for n in per_table]
    expected = {f"step{s}/{n}" for s in range(STEPS) for n in names} | {
        f"weight/ebc.embedding_bags.{t.name}.weight" for t in tables
    }
    for rank, result in enumerate(per_rank):
        diffs = result[pooling]
        assert set(diffs) == expected, (rank, sorted(set(diffs) ^ expected))
        worst = {k: v for k, v in diffs.items() if v > ATOL}
        assert not worst, (ws, rank, pooling, worst)
