"""Under TrainPipelineSparseDist (which starts batch i+1's input dist during step i, through its own KJT all-to-all
forward), a bad batch on one rank is every rank's error too: all ranks raise the same named error from the same
`progress` call, within seconds, and none waits for the process group's timeout.

One 4-rank spawn (2 nodes x 2) of test_sharding_pipeline's model (grid, hierarchical, data-parallel, table-wise and
unique-based tables behind one EBC); rank 1's third batch has an ID past its table's rows.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from tests.sharding import test_sharding_pipeline as P
from embark_torchrec.sharding.validation import InvalidInputError
from embark_torchrec.testing import run_ranks

BAD_RANK, BAD_STEP = 1, 2
WITHIN_S = 5.0


def _bad_ids(batch: Batch) -> tuple[Batch, str]:
    """The batch with its first ID of the first feature that has one set to its table's row count, and the words
    the error must have."""
    kjt = batch.sparse_features
    per_key, offsets = kjt.length_per_key(), kjt.offset_per_key()
    k = next(i for i, n in enumerate(per_key) if n)
    feature = kjt.keys()[k]
    table = next(t for t in P.TABLES if feature in t.feature_names)
    values = kjt.values().clone()
    values[offsets[k]] = table.num_embeddings
    bad = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths(), weights=kjt.weights_or_none())
    words = f"rank {BAD_RANK}: feature {feature!r} of table {table.name!r} has IDs [{table.num_embeddings}]"
    return Batch(dense_features=batch.dense_features, sparse_features=bad, labels=batch.labels), words


def _pipeline_with_one_bad_batch() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(P.SEED)
    model, optimizer = P._sharded(P.DenseSparseModel(torch.device("cpu")))
    batches = P._batches(rank)
    words = ""
    if rank == BAD_RANK:
        batches[BAD_STEP], words = _bad_ids(batches[BAD_STEP])
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"), execute_all_batches=True)
    iterator = iter(batches)
    for call in range(P.STEPS):
        start = time.monotonic()
        try:
            pipeline.progress(iterator)
        except InvalidInputError as exc:
            error = f"{type(exc).__name__}: {exc}"
            return {"call": call, "error": error, "seconds": time.monotonic() - start, "words": words}
    return {"call": None, "error": "no error", "seconds": 0.0, "words": words}


def test_a_bad_batch_on_one_rank_under_the_pipeline_is_every_ranks_error() -> None:
    results = run_ranks(_pipeline_with_one_bad_batch, P.WORLD_SIZE, local_world_size=P.LOCAL_WORLD_SIZE, timeout_s=300)
    texts = {r["error"] for r in results}
    assert len(texts) == 1, texts
    (text,) = texts
    assert text.startswith(f"InvalidIdError: {results[BAD_RANK]['words']}"), text
    calls = {r["call"] for r in results}  # batch i+1's input dist runs (and its error comes) in step i, on every rank
    assert len(calls) == 1 and calls <= set(range(BAD_STEP + 1)), calls
    assert all(r["seconds"] <= WITHIN_S for r in results), [r["seconds"] for r in results]
