"""Communication accounting: the bytes the runtime counts equal the bytes the cost model predicts.

One 4-rank spawn (2 nodes x 2) trains one step of a model holding an RB grid (flat), an RB grid with hierarchical
reduction and two cells of a row slice on one rank, another at fp8 on the wire, table-wise and column-wise tables
on TorchRec's own shardings, row-wise and table-row-wise ones (TorchRec's reduce-scatters, counted per sharding
group, each holding one table here), three UB tables (a grid at fp16/bf16 on the wire, a row split, a row split at
fp8/fp16) and a DP table, on Zipf IDs. The counters measure the payloads handed to each collective (the KJT
tensors; our all-to-alls' encoded payload per member, which the per-table split must add up to, or counting
raises). Every rank's counted bytes, per table, kind (ids, lengths, embeddings, gradients) and peer, must equal
traffic.table_messages given the batch's actual IDs per row slice (RB) and distinct IDs per row slice (UB), exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.cost import CostModel
from embark_torchrec.plan.layout import TableLayout, WirePrecision
from embark_torchrec.plan.spec import ModelSpec, TableSpec
from embark_torchrec.plan.topology import Topology
from embark_torchrec.plan.traffic import table_messages
from embark_torchrec.sharding.comm_stats import enable_comm_stats
from embark_torchrec.sharding.torchrec_counting import ALL_TABLES
from embark_torchrec.testing import global_kjt_batch, ids_per_row_slice, run_ranks
from embark_torchrec.testing.training import sharded_model

WS, LWS, BATCH, SEED = 4, 2, 6, 5
KINDS = ("ids", "lengths", "embeddings", "gradients")
TABLES = [
    EmbeddingBagConfig(name="rb_flat", num_embeddings=40, embedding_dim=16, feature_names=["a0", "a1"]),
    EmbeddingBagConfig(name="rb_hier", num_embeddings=30, embedding_dim=8, feature_names=["h"]),
    EmbeddingBagConfig(name="tw", num_embeddings=20, embedding_dim=12, feature_names=["t"]),
    EmbeddingBagConfig(name="ub_grid", num_embeddings=24, embedding_dim=8, feature_names=["u0", "u1"]),
    EmbeddingBagConfig(name="ub_rows", num_embeddings=50, embedding_dim=4, feature_names=["r"]),
    EmbeddingBagConfig(name="dp", num_embeddings=10, embedding_dim=4, feature_names=["d"]),
    EmbeddingBagConfig(name="cw", num_embeddings=20, embedding_dim=8, feature_names=["c"]),
    EmbeddingBagConfig(name="rb_fp8", num_embeddings=30, embedding_dim=8, feature_names=["e"]),
    EmbeddingBagConfig(name="ub_fp8", num_embeddings=40, embedding_dim=8, feature_names=["q0", "q1"]),
    EmbeddingBagConfig(name="rw", num_embeddings=22, embedding_dim=8, feature_names=["w"]),
    EmbeddingBagConfig(name="rb_fp16", num_embeddings=26, embedding_dim=8, feature_names=["g"]),
    EmbeddingBagConfig(name="rb_hier_bf16", num_embeddings=32, embedding_dim=8, feature_names=["b"]),
    EmbeddingBagConfig(name="rb_flat_fp8", num_embeddings=28, embedding_dim=12, feature_names=["z0", "z1"]),
    EmbeddingBagConfig(name="twrw", num_embeddings=18, embedding_dim=4, feature_names=["x"]),
]
LAYOUTS = {
    "rb_flat": TableLayout("rb", (0, 13, 40), (0, 8, 16), ((0, 1), (3, 2))),
    "rb_hier": TableLayout("rb", (0, 10, 30), (0, 4, 8), ((1, 1), (2, 0)), hierarchical=True),
    "tw": TableLayout.table_wise(20, 12, 3),
    "ub_grid": TableLayout("ub", (0, 9, 24), (0, 4, 8), ((3, 0), (1, 3)), WirePrecision("fp16", "bf16")),
    "ub_rows": TableLayout("ub", (0, 7, 31, 50), (0, 4), ((2,), (0,), (3,))),
    "dp": TableLayout.data_parallel(),
    "cw": TableLayout("rb", (0, 20), (0, 4, 8), ((0, 3),)),  # TorchRec's column-wise
    "rb_fp8": TableLayout(
        "rb", (0, 12, 30), (0, 4, 8), ((2, 1), (0, 3)), WirePrecision("fp8", "fp8"), hierarchical=True
    ),
    "ub_fp8": TableLayout("ub", (0, 15, 40), (0, 8), ((1,), (2,)), WirePrecision("fp8", "fp16")),
    "rw": TableLayout("rb", (0, 6, 12, 18, 22), (0, 8), ((0,), (1,), (2,), (3,))),  # TorchRec's row-wise
    "rb_fp16": TableLayout("rb", (0, 10, 26), (0, 8), ((1,), (3,)), WirePrecision("fp16", "bf16")),
    "rb_hier_bf16": TableLayout(
        "rb", (0, 16, 32), (0, 4, 8), ((0, 1), (3, 2)), WirePrecision("bf16", "fp16"), hierarchical=True
    ),
    "rb_flat_fp8": TableLayout("rb", (0, 14, 28), (0, 4, 12), ((0, 2), (2, 1)), WirePrecision("fp8", "fp8")),
    "twrw": TableLayout("rb", (0, 9, 18), (0, 4), ((2,), (3,)), hierarchical=True),  # TorchRec's table-row-wise
}
# TorchRec's reduce-scatters count a whole sharding group at once ("*"); each of these groups holds one table
GROUP_OF_ONE = {"row_wise": "rw", "table_row_wise": "twrw"}


def _batches() -> list[KeyedJaggedTensor]:
    """The global batch, with int32 lengths (what the cost model assumes on the wire)."""
    out = []
    for kjt in global_kjt_batch(TABLES, WS, BATCH, seed=SEED, ids="zipf", max_bag_size=6):
        out.append(
            KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths().to(torch.int32), stride=BATCH)
        )
    return out


def _one_step() -> dict[str, Any]:
    rank = dist.get_rank()
    model = sharded_model(TABLES, LAYOUTS, LWS)
    stats = enable_comm_stats(model)
    assert enable_comm_stats(model) is stats
    out = model(_batches()[rank])
    out = (out.wait() if hasattr(out, "wait") else out).to_dict()
    gen = torch.Generator().manual_seed(rank)
    loss = sum((v * torch.randn(v.shape, generator=gen)).sum() for v in out.values())
    loss.backward()
    by_table: dict[tuple[str, str], np.ndarray] = {}
    for k in stats.keys():
        table = GROUP_OF_ONE.get(k.sharding_type, k.table) if k.table == ALL_TABLES else k.table
        by_table[(table, k.kind)] = by_table.get((table, k.kind), 0) + stats.per_peer(k)
    return {
        "counted": by_table,
        "sharding_types": sorted({k.sharding_type for k in stats.keys()}),
        "render": stats.render(),
        "totals": stats.totals(),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_one_step, WS, local_world_size=LWS, timeout_s=300)


def _predicted(table: EmbeddingBagConfig) -> dict[str, np.ndarray]:
    """Per kind: [W, 2, W] bytes each rank sends to / receives from each peer, from the message model."""
    spec = ModelSpec(
        "m",
        WS * BATCH,
        tuple(TableSpec(t.name, t.num_embeddings, t.embedding_dim, 1.0, tuple(t.feature_names)) for t in TABLES),
    )
    cost = CostModel(spec, Topology(WS, LWS))
    layout = LAYOUTS[table.name]
    out = {kind: np.zeros((WS, 2, WS)) for kind in KINDS}
    ids = None
    if layout.cluster != "dp":
        ids = ids_per_row_slice(_batches(), table.feature_names, layout.row_bounds, layout.cluster == "ub")
    for m in table_messages(cost, table.name, layout, ids):
        out[m.kind][m.src, 0, m.dst] += m.nbytes
        out[m.kind][m.dst, 1, m.src] += m.nbytes
    return out


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_counted_bytes_equal_predicted_bytes(results: list[dict[str, Any]], table: EmbeddingBagConfig) -> None:
    """Per rank, peer and kind, the counted bytes equal the cost model's messages for this batch, exactly."""
    predicted = _predicted(table)
    for kind in KINDS:
        for rank, r in enumerate(results):
            counted = r["counted"].get((table.name, kind), np.zeros((2, WS)))
            np.testing.assert_array_equal(counted, predicted[kind][rank], err_msg=f"{table.name} {kind} rank {rank}")
    if table.name != "dp":  # not vacuous: the table moved bytes of every kind
        assert all(predicted[kind].sum() > 0 for kind in KINDS), table.name


def test_every_cluster_is_counted_and_printable(results: list[dict[str, Any]]) -> None:
    """Our three dists and TorchRec's table-wise one all record; totals add up; render names every table."""
    for r in results:
        assert {"embark_rb", "embark_rb_hier", "embark_ub", "table_wise", "column_wise"} <= {
            c.split(":")[0] for c in r["sharding_types"]
        }
        t = r["totals"]
        assert t["sent"] == t["sent_intra"] + t["sent_inter"] and t["sent_inter"] > 0
        for name in (
            "rb_flat",
            "rb_hier",
            "tw",
            "ub_grid",
            "ub_rows",
            "cw",
            "rb_fp8",
            "ub_fp8",
            "rb_fp16",
            "rb_flat_fp8",
            "rb_hier_bf16",
        ):
            assert name in r["render"]
