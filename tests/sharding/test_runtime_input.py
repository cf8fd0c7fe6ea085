"""Runtime input that used to crash deep inside fbgemm or gloo: each works exactly or is refused by name before the
collective that would fail.

- Ranks with different batch sizes, a rank with no samples, and a batch with no samples on any rank train exactly
  like an unsharded EmbeddingBagCollection on our grid, hierarchical grid and unique-based types and TorchRec's
  table-wise and data-parallel (2 ranks, and 4 as 2 nodes x 2);
- TorchRec's row-wise, whose reduce-scatter needs equal batches, gets a named error on every rank instead of gloo's
  "invalid tensor size" (no rank hangs);
- float IDs (which some kernels silently truncated, others rejected) are refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.sharding.validation import InvalidInputError
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import compare_sharded_training, sharded_model

ATOL = 1e-5
WORLDS = {2: 2, 4: 2}
SIZES = {2: {"unequal": [3, 5], "one_empty": [0, 4], "all_empty": [0, 0]}, 4: {"unequal": [2, 0, 5, 3]}}
LAYOUTS: dict[str, dict[int, TableLayout]] = {
    "grid": {
        2: TableLayout("rb", (0, 13, 40), (0, 8, 16), ((0, 1), (1, 0))),
        4: TableLayout("rb", (0, 13, 40), (0, 8, 16), ((0, 1), (3, 2))),
    },
    "ub": {
        2: TableLayout("ub", (0, 20, 40), (0, 16), ((1,), (0,))),
        4: TableLayout("ub", (0, 20, 40), (0, 16), ((3,), (0,))),
    },
    "hier": {4: TableLayout("rb", (0, 20, 40), (0, 8, 16), ((1, 2), (3, 0)), hierarchical=True)},
    "tw": {ws: TableLayout.table_wise(40, 16, ws - 1) for ws in WORLDS},
    "dp": {ws: TableLayout.data_parallel() for ws in WORLDS},
}


def _tables(ws: int) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    names = [n for n, per_world in LAYOUTS.items() if ws in per_world]
    tables = [EmbeddingBagConfig(name=n, num_embeddings=40, embedding_dim=16, feature_names=[f"{n}_f"]) for n in names]
    return tables, {n: LAYOUTS[n][ws] for n in names}


def _error(fn: Any) -> str | None:
    try:
        fn()
    except InvalidInputError as e:
        return str(e)
    return None


def _run(lws: int) -> dict[str, Any]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    tables, layouts = _tables(ws)
    out: dict[str, Any] = {
        case: compare_sharded_training(tables, layouts, lws, batch_per_rank=sizes, optimizer="adagrad", seed=ws)
        for case, sizes in SIZES[ws].items()
    }
    one = [EmbeddingBagConfig(name="rw", num_embeddings=40, embedding_dim=8, feature_names=["rw_f"])]
    rw = sharded_model(
        one,
        {"rw": TableLayout("rb", tuple(i * 40 // ws for i in range(ws + 1)), (0, 8), tuple((k,) for k in range(ws)))},
        lws,
    )
    n = 3 + rank
    batch = KeyedJaggedTensor.from_lengths_sync(
        keys=["rw_f"], values=torch.arange(n), lengths=torch.ones(n, dtype=torch.int32)
    )
    out["rw_unequal"] = _error(lambda: rw(batch))
    floats = KeyedJaggedTensor.from_lengths_sync(
        keys=["rw_f"], values=torch.tensor([1.5, 2.0]), lengths=torch.tensor([1, 1])
    )
    out["float_ids"] = _error(lambda: rw(floats))
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=sorted(WORLDS))
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ws = request.param
    return ws, run_ranks(_run, ws, local_world_size=WORLDS[ws], timeout_s=300, args=(WORLDS[ws],))


def test_unequal_and_empty_batches_train_like_unsharded(results: tuple[int, list[dict[str, Any]]]) -> None:
    ws, per_rank = results
    tables, _ = _tables(ws)
    for case in SIZES[ws]:
        for rank, result in enumerate(per_rank):
            diffs = result[case]
            assert {f"weight/ebc.embedding_bags.{t.name}.weight" for t in tables} <= set(diffs), case
            worst = {k: v for k, v in diffs.items() if v > ATOL}
            assert not worst, (ws, case, rank, worst)


def test_row_wise_with_unequal_batches_is_refused_by_name_on_every_rank(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, per_rank = results
    sizes = ", ".join(f"rank {r}: {3 + r}" for r in range(ws))
    for rank, result in enumerate(per_rank):
        message = result["rw_unequal"]
        assert message is not None and f"rank {rank}:" in message and "row_wise" in message and sizes in message, (
            message
        )


def test_float_ids_are_refused_by_name(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for result in per_rank:
        assert result["float_ids"] is not None and "torch.float32" in result["float_ids"], result["float_ids"]
