"""Communication accounting: the bytes the runtime counts equal the bytes the cost model predicts.

One 4-rank spawn (2 nodes x 2) trains one step of a model holding an RB grid (flat), an RB grid with hierarchical
reduction and two cells of a row slice on one rank, another at fp8 on the wire, table-wise and column-wise tables on
TorchRec's own shardings, row-wise and table-row-wise ones (TorchRec's reduce-scatters, counted per sharding group,
each holding one table here), three UB tables (a grid at fp16/bf16 on the wire, a row split, a row split at
fp8/fp16) and a DP table, TorchRec's table-wise, row-wise and table-row-wise at fp16 / bf16, and its table-wise and
column-wise at fp8 (our row-scaled codec told the group's row width), on Zipf IDs. The
counters measure the payloads handed to each collective (the KJT tensors; our all-to-alls' encoded payload per
member, which the per-table split must add up to, or counting raises). Every rank's counted bytes, per table, kind
(ids, lengths, embeddings, gradients) and peer, must equal traffic.table_messages given the batch's actual IDs per
row slice (RB) and distinct IDs per row slice (UB), exactly.

The module's split exchange (sharding/input_exchange.py: every group's split sizes and the rank's input-fault record,
once per module and batch) is counted as "metadata": per rank and peer it must equal traffic.split_exchange_messages
and the bytes each exchange hands all_to_all_single, recorded by a stand-in for input_exchange's torch.distributed,
in this model, in a module of one data-parallel table (whose only collective besides DDP's is this exchange), and in
test_sharding_pipeline's model trained under TrainPipelineSparseDist.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.sharding import test_sharding_pipeline as P
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.groups import sharding_group
from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision
from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology
from embark_torchrec.plan.cost.traffic import Message, split_exchange_messages, table_messages
from embark_torchrec.plan.layout.wire import intra_node_reduction_precision
from embark_torchrec.sharding import input_exchange
from embark_torchrec.sharding.comm_stats import INPUT_EXCHANGE, CommKey, CommStats, enable_comm_stats, group_ranks
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
    EmbeddingBagConfig(name="tw_fp16", num_embeddings=20, embedding_dim=8, feature_names=["t16"]),
    EmbeddingBagConfig(name="rw_bf16", num_embeddings=20, embedding_dim=8, feature_names=["w16"]),
    EmbeddingBagConfig(name="twrw_fp16", num_embeddings=14, embedding_dim=4, feature_names=["x16"]),
    EmbeddingBagConfig(name="tw_fp8", num_embeddings=20, embedding_dim=12, feature_names=["t8a", "t8b"]),
    EmbeddingBagConfig(name="cw_fp8", num_embeddings=20, embedding_dim=8, feature_names=["c8"]),
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
    # TorchRec's own shardings at fp16 / bf16, the plan's codecs as their registry
    "tw_fp16": TableLayout("rb", (0, 20), (0, 8), ((2,),), WirePrecision("fp16", "bf16")),
    "rw_bf16": TableLayout("rb", (0, 5, 10, 15, 20), (0, 8), ((0,), (1,), (2,), (3,)), WirePrecision("bf16", "fp16")),
    "twrw_fp16": TableLayout("rb", (0, 7, 14), (0, 4), ((0,), (1,)), WirePrecision("fp16", "fp16"), hierarchical=True),
    # TorchRec's table-wise and column-wise at fp8 (the plan chose them): our row-scaled codec told the row width
    "tw_fp8": TableLayout("rb", (0, 20), (0, 12), ((1,),), WirePrecision("fp8", "fp8"), torchrec_at_fp8=True),
    "cw_fp8": TableLayout("rb", (0, 20), (0, 4, 8), ((2, 1),), WirePrecision("fp8", "fp8"), torchrec_at_fp8=True),
}
# TorchRec's reduce-scatters count a whole sharding group at once ("*"); each of these groups holds one table
GROUP_OF_ONE = {
    "row_wise": "rw",
    "table_row_wise": "twrw",
    "row_wise:bf16-fp16": "rw_bf16",
    "table_row_wise:fp16-fp16": "twrw_fp16",
}


def _batches(tables: list[EmbeddingBagConfig] = TABLES) -> list[KeyedJaggedTensor]:
    """The global batch, with int32 lengths (what the cost model assumes on the wire)."""
    out = []
    for kjt in global_kjt_batch(tables, WS, BATCH, seed=SEED, ids="zipf", max_bag_size=6):
        out.append(
            KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths().to(torch.int32), stride=BATCH)
        )
    return out


DP_TABLE = next(t for t in TABLES if t.name == "dp")
EXCHANGE_KEY = CommKey(INPUT_EXCHANGE, ALL_TABLES, "metadata")


class _RecordedExchanges:
    """Stands in for input_exchange's torch.distributed: adds up, per peer, the bytes each split exchange hands
    all_to_all_single (its input and output split evenly over the group's members), then runs it."""

    def __init__(self) -> None:
        self.calls = 0
        self.per_peer = np.zeros((2, WS))  # sent to / received from each global rank

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool) -> Any:
        peers = group_ranks(group)
        for side, tensor in enumerate((input, output)):
            for peer, chunk in zip(peers, tensor.chunk(len(peers))):
                self.per_peer[side, peer] += chunk.numel() * chunk.element_size()
        self.calls += 1
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)


@contextlib.contextmanager
def _recorded_exchanges() -> Iterator[_RecordedExchanges]:
    recorded = _RecordedExchanges()
    input_exchange.dist = recorded  # type: ignore[assignment]
    try:
        yield recorded
    finally:
        input_exchange.dist = dist


def _exchange(run: Callable[[], CommStats]) -> tuple[CommStats, dict[str, Any]]:
    """`run`'s CommStats, and what it counted as metadata (only the split exchange's key may hold any) and what its
    exchanges handed the collective, none to oneself."""
    with _recorded_exchanges() as recorded:
        stats = run()
    recorded.per_peer[:, dist.get_rank()] = 0.0
    return stats, {
        "counted": stats.per_peer(EXCHANGE_KEY),
        "passed": recorded.per_peer,
        "calls": recorded.calls,
        "metadata_keys": [k for k in stats.keys() if k.kind == "metadata"],
    }


def _train_one_step(model: torch.nn.Module, kjt: KeyedJaggedTensor) -> None:
    out = model(kjt)
    out = (out.wait() if hasattr(out, "wait") else out).to_dict()
    gen = torch.Generator().manual_seed(dist.get_rank())
    loss = sum((v * torch.randn(v.shape, generator=gen)).sum() for v in out.values())
    loss.backward()


def _counted_step(tables: list[EmbeddingBagConfig], layouts: dict[str, TableLayout]) -> CommStats:
    """One training step of these tables sharded by `layouts`, counted from its start."""
    model = sharded_model(tables, layouts, LWS)
    stats = enable_comm_stats(model)
    assert enable_comm_stats(model) is stats
    _train_one_step(model, _batches(tables)[dist.get_rank()])
    return stats


def _pipelined_steps() -> CommStats:
    """test_sharding_pipeline's model and batches, trained through TrainPipelineSparseDist."""
    torch.manual_seed(P.SEED)
    model, optimizer = P._sharded(P.DenseSparseModel(torch.device("cpu")))
    stats = enable_comm_stats(model)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"), execute_all_batches=True)
    iterator = iter(P._batches(dist.get_rank()))
    with contextlib.suppress(StopIteration):
        while True:
            pipeline.progress(iterator)
    return stats


def _one_step() -> dict[str, Any]:
    stats, exchange = _exchange(lambda: _counted_step(TABLES, LAYOUTS))
    by_table: dict[tuple[str, str], np.ndarray] = {}
    for k in stats.keys():
        table = GROUP_OF_ONE.get(k.sharding_type, k.table) if k.table == ALL_TABLES else k.table
        by_table[(table, k.kind)] = by_table.get((table, k.kind), 0) + stats.per_peer(k)
    return {
        "counted": by_table,
        "sharding_types": sorted({k.sharding_type for k in stats.keys()}),
        "render": stats.render(),
        "totals": stats.totals(),
        "exchanges": {
            "one_step": exchange,
            "data_parallel": _exchange(lambda: _counted_step([DP_TABLE], {"dp": LAYOUTS["dp"]}))[1],
            "pipelined": _exchange(_pipelined_steps)[1],
        },
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_one_step, WS, local_world_size=LWS, timeout_s=300)


def _per_rank(messages: Iterable[Message]) -> np.ndarray:
    """[W, 2, W] bytes each rank sends to / receives from each peer."""
    out = np.zeros((WS, 2, WS))
    for m in messages:
        out[m.src, 0, m.dst] += m.nbytes
        out[m.dst, 1, m.src] += m.nbytes
    return out


def _groups(tables: Iterable[EmbeddingBagConfig], layouts: dict[str, TableLayout]) -> int:
    return len({sharding_group(layouts[t.name], t.num_embeddings, WS, LWS).name for t in tables})


# per case of _one_step's exchanges: (the module's sharding groups, its batches)
EXCHANGE_CASES = {
    "one_step": (_groups(TABLES, LAYOUTS), 1),
    "data_parallel": (1, 1),
    "pipelined": (_groups(P.TABLES, P.LAYOUTS), P.STEPS),
}


@pytest.mark.parametrize("case", sorted(EXCHANGE_CASES))
def test_split_exchange_counted_equals_predicted_and_passed(results: list[dict[str, Any]], case: str) -> None:
    """Per rank and peer, the split exchange's counted metadata bytes equal traffic.split_exchange_messages once per
    module and batch, and the bytes its tensors hand all_to_all_single; it is the only metadata counted."""
    groups, batches = EXCHANGE_CASES[case]
    predicted = batches * _per_rank(split_exchange_messages(WS, groups))
    for rank, r in enumerate(results):
        exchange = r["exchanges"][case]
        assert exchange["metadata_keys"] == [EXCHANGE_KEY], (case, rank)
        assert exchange["calls"] == batches, (case, rank)
        np.testing.assert_array_equal(exchange["counted"], predicted[rank], err_msg=f"{case} rank {rank}")
        np.testing.assert_array_equal(exchange["passed"], predicted[rank], err_msg=f"{case} rank {rank}")
    assert predicted.sum() > 0


def _predicted(table: EmbeddingBagConfig, layout: TableLayout | None = None) -> dict[str, np.ndarray]:
    """Per kind: [W, 2, W] bytes each rank sends to / receives from each peer, from the message model, of the
    table's layout (or `layout`)."""
    spec = ModelSpec(
        "m",
        WS * BATCH,
        tuple(TableSpec(t.name, t.num_embeddings, t.embedding_dim, 1.0, tuple(t.feature_names)) for t in TABLES),
    )
    cost = CostModel(spec, Topology(WS, LWS))
    layout = LAYOUTS[table.name] if layout is None else layout
    ids = None
    if layout.cluster != "dp":
        ids = ids_per_row_slice(_batches(), table.feature_names, layout.row_bounds, layout.cluster == "ub")
    messages = table_messages(cost, table.name, layout, ids)
    return {kind: _per_rank(m for m in messages if m.kind == kind) for kind in KINDS}


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


def test_hierarchical_fp8_reduces_inside_nodes_at_fp32(results: list[dict[str, Any]]) -> None:
    """Stage 1 of a hierarchical fp8 layout sends its partial sums at fp32 (wire.intra_node_reduction_precision): per
    rank, the embeddings and gradients it counts with its own node's ranks are the same layout's bytes at fp32,
    those with other nodes its bytes at fp8."""
    assert intra_node_reduction_precision("fp8") == "fp32"
    table = next(t for t in TABLES if t.name == "rb_fp8")
    layout = LAYOUTS["rb_fp8"]
    at_fp8, at_fp32 = _predicted(table), _predicted(table, dataclasses.replace(layout, precision=WirePrecision()))
    node = np.arange(WS) // LWS
    for kind in ("embeddings", "gradients"):
        for rank, r in enumerate(results):
            counted, here = r["counted"][(table.name, kind)], node == node[rank]
            np.testing.assert_array_equal(counted[:, here], at_fp32[kind][rank][:, here], err_msg=f"{kind} {rank}")
            np.testing.assert_array_equal(counted[:, ~here], at_fp8[kind][rank][:, ~here], err_msg=f"{kind} {rank}")
        intra = sum(r["counted"][(table.name, kind)][:, node == node[rank]].sum() for rank, r in enumerate(results))
        assert intra > 0 and not np.array_equal(at_fp8[kind], at_fp32[kind]), kind  # not vacuous


def test_every_cluster_is_counted_and_printable(results: list[dict[str, Any]]) -> None:
    """Our three dists and TorchRec's all record (its table-wise and column-wise at fp8 too); totals add up; render
    names every table."""
    for r in results:
        assert {"embark_rb", "embark_rb_hier", "embark_ub", "table_wise", "column_wise"} <= {
            c.split(":")[0] for c in r["sharding_types"]
        }
        assert {
            "table_wise:fp16-bf16",
            "row_wise:bf16-fp16",
            "table_row_wise:fp16-fp16",
            "table_wise:fp8-fp8@12",
            "column_wise:fp8-fp8@4",
        } <= set(r["sharding_types"])
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
            "tw_fp16",
            "tw_fp8",
            "cw_fp8",
        ):
            assert name in r["render"]
