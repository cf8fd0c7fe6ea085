"""Our fp8 row-wise codec is a QuantizedCommCodec TorchRec's own dists take: given the row width, as the sharder's
codec registry (QCommsConfig's way, where TorchRec's own FP8 codec has no CPU kernel), TorchRec's table-wise and
column-wise shardings send their vectors at fp8 with one scale each, outputs within fp8's rounding of the fp32
model (and not equal to it: the codec ran), and the byte counters on TorchRec's dists count what the codec sends
(values + one fp32 scale per vector, plan/layout/wire.py), not the elements handed to it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision
from embark_torchrec.plan.layout.wire import rows_bytes
from embark_torchrec.sharding.codecs import Fp8RowwiseCodec, wire_codecs
from embark_torchrec.sharding.comm_stats import enable_comm_stats
from embark_torchrec.testing import copy_global_weights, global_kjt_batch, run_ranks
from embark_torchrec.testing.training import SparseArch, sharded_model

WS, LWS, BATCH, WIDTH = 4, 2, 4, 8
TABLES = [
    EmbeddingBagConfig(name="tw", num_embeddings=30, embedding_dim=WIDTH, feature_names=["a", "b"]),
    EmbeddingBagConfig(name="cw", num_embeddings=24, embedding_dim=2 * WIDTH, feature_names=["c"]),
]
LAYOUTS = {
    "tw": TableLayout.table_wise(30, WIDTH, 1),
    "cw": TableLayout("rb", (0, 24), (0, WIDTH, 2 * WIDTH), ((0, 3),)),
}
HOLDERS = {"tw": [1], "cw": [0, 3]}  # the ranks holding each table's vectors (one column shard each for cw)
FEATURES = {"tw": 2, "cw": 1}


def _run() -> dict[str, Any]:
    torch.manual_seed(0)
    reference = SparseArch(TABLES, False, torch.device("cpu"))
    registry = wire_codecs(WirePrecision("fp8", "fp8"), row_width=WIDTH)
    model = sharded_model(TABLES, LAYOUTS, LWS, qcomm_codecs_registry=registry)
    copy_global_weights(model, reference)
    stats = enable_comm_stats(model)
    batches = global_kjt_batch(TABLES, WS, BATCH, seed=1, ids="zipf")
    out = model(batches[dist.get_rank()])
    out = (out.wait() if hasattr(out, "wait") else out).to_dict()
    expected = reference(batches[dist.get_rank()]).to_dict()
    diffs = {k: float((out[k] - expected[k]).abs().max()) for k in expected}
    scale = max(float(v.abs().max()) for v in expected.values())
    counted = {key.table: stats.per_peer(key) for key in stats.keys() if key.kind == "embeddings"}
    return {"types": sorted({key.sharding_type for key in stats.keys()}), "diffs": diffs, "scale": scale, **counted}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_run, WS, local_world_size=LWS, timeout_s=300)


def test_torchrec_shardings_run_our_fp8_codec_from_the_sharders_registry(results: list[dict[str, Any]]) -> None:
    """Both tables run on TorchRec's own types; every output is within two fp8 roundings (2^-4 relative each, on the
    largest output) of the fp32 model's, and some differ."""
    for r in results:
        assert {"column_wise", "table_wise"} <= set(r["types"]) and not any(t.startswith("embark") for t in r["types"])
        assert max(r["diffs"].values()) <= 2 * 2.0**-4 * r["scale"], r["diffs"]
        assert max(r["diffs"].values()) > 0.0, r["diffs"]


def test_counted_bytes_are_the_codecs_values_and_scales(results: list[dict[str, Any]]) -> None:
    """Each holder sends every other rank BATCH samples x features x one vector of WIDTH per shard, at 1 byte per
    value and 4 per vector's scale; nothing else is counted as embeddings."""
    for table, holders in HOLDERS.items():
        vectors = BATCH * FEATURES[table]
        per_message = float(rows_bytes(vectors * WIDTH, vectors, "fp8"))
        for rank, r in enumerate(results):
            sent = np.zeros(WS)
            if rank in holders:
                sent[:] = per_message
                sent[rank] = 0.0
            np.testing.assert_array_equal(r[table][0], sent, err_msg=f"{table} rank {rank}")
            assert per_message != vectors * WIDTH * 1.0  # the scales are counted
    assert Fp8RowwiseCodec(WIDTH).calc_quantized_size(3 * WIDTH, Fp8RowwiseCodec(WIDTH).create_context()) == 3 * (
        WIDTH + 4
    )
