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

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.testing import run_ranks
from tests.support import toy

pytestmark = pytest.mark.torchrec_version

ATOL = 1e-5
STEPS = 2
WORLDS = {2: 2, 4: 2}
TABLES = {
    "grid": toy.Table(40, 16, ["f0", "f1"], {ws: toy.grid(ws, columns=(0, 4, 16)) for ws in WORLDS}),
    "ub": toy.Table(24, 8, ["f2"], {ws: toy.unique(ws) for ws in WORLDS}),
    "hier": toy.Table(36, 12, ["f0", "f3"], {ws: toy.hierarchical_grid(ws, dim=12) for ws in WORLDS}),
    "tw": toy.Table(20, 12, ["f4"], {ws: TableLayout.table_wise(20, 12, ws - 1) for ws in WORLDS}),
    "cw": toy.Table(
        18,
        16,
        ["f5"],
        {2: TableLayout("rb", (0, 18), (0, 8, 16), ((1, 0),)), 4: TableLayout("rb", (0, 18), (0, 8, 16), ((2, 3),))},
    ),
}
CONFIGS = [("sum", "sgd"), ("mean", "sgd"), ("weighted", "sgd")]  # fbgemm's VBE TBE takes no EXACT_ADAGRAD


@pytest.fixture(scope="module", params=sorted(WORLDS))
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ws = request.param
    args = (TABLES, CONFIGS, WORLDS[ws], STEPS, ws + 7)
    per_rank = run_ranks(
        toy.train_each_pooling,
        ws,
        local_world_size=WORLDS[ws],
        timeout_s=400,
        args=args,
        kwargs={"variable_batch": True},
    )
    return ws, per_rank


@pytest.mark.parametrize("pooling", [c[0] for c in CONFIGS])
def test_variable_batch_trains_like_unsharded(results: tuple[int, list[dict[str, Any]]], pooling: str) -> None:
    ws, per_rank = results
    tables, _ = toy.ebc_tables(TABLES, ws, pooling)
    toy.assert_trained_like_unsharded([result[pooling] for result in per_rank], tables, STEPS, ATOL, (ws, pooling))
