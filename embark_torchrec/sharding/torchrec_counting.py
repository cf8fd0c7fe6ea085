"""Byte counting for the all-to-alls our dists borrow from TorchRec and for TorchRec's own shardings.

Hooks on TorchRec's collective modules (KJTAllToAll, PooledEmbeddingsAllToAll,
PooledEmbeddingsReduceScatter) read the tensors each call sends and receives. KJTs are counted per
key, so bytes go to the table of each key; pooled all-to-alls per column, from the sharding's
per-rank embedding dims; reduce-scatters (torchrec's row-wise and table-row-wise) count their
logical messages (each rank's chunk for each peer, and the all-gather of gradients back) and are
attributed to the sharding's tables together (ALL_TABLES). The KJT all-to-alls' split sizes travel in
their module's split exchange (input_exchange.py), counted apart (comm_stats.SplitsExchangeCounter).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torchrec.distributed.dist_data import KJTAllToAll, PooledEmbeddingsAllToAll, PooledEmbeddingsReduceScatter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .comm_stats import ALL_TABLES, CommStats, Ledger, group_ranks
from .torchrec_compat import (
    build_lazy_output_dists,
    collective_codecs,
    collective_group,
    emb_dims_per_rank,
    has_emb_dims_per_rank,
    kjt_splits,
    pooled_dim_sum_per_rank,
    received_peer_order,
)


def base_feature(key: str) -> str:
    """The feature a KJT key stands for (our grid cells are virtual features "feature#r.c")."""
    return key.split("#", 1)[0]


class KJTCounter:
    """Counts one KJTAllToAll: lengths, IDs and weights per key and peer. The sent side is read
    when the all-to-all is called (which only records what it will send: input_exchange.py, or
    TrainPipelineSparseDist's forward); the received side from what the lookup gets
    (record_received), since the tensor all-to-all is built after the module's split exchange.

    IDs per key and peer are summed on the device, step after step, and read (one host sync) only
    when the statistics are (flush, called by CommStats); bag counts are known on the host."""

    def __init__(self, a2a: KJTAllToAll, stats: CommStats, sharding_type: str, feature_table: Dict[str, str]) -> None:
        self._stats, self._sharding_type, self._feature_table = stats, sharding_type, feature_table
        self._peers = group_ranks(collective_group(a2a))
        self._splits = kjt_splits(a2a)
        self._peer_of_key = np.repeat(np.arange(len(self._peers)), self._splits)
        self._received_from = received_peer_order(a2a, len(self._peers))  # output segment -> peer
        self._sent: Optional[torch.Tensor] = None  # IDs sent per key (device)
        self._received: Optional[torch.Tensor] = None  # IDs received per (key, peer) (device)
        self._sent_keys: List[str] = []
        self._received_keys: List[str] = []
        self._id_bytes = self._weight_bytes = 0
        stats.add_source(self)

    def __call__(self, module: KJTAllToAll, args: Any, output: Any) -> None:
        sent = args[0]
        keys = sent.keys()
        if keys:
            ids = sent.lengths().view(len(keys), -1).sum(dim=1)
            self._sent = ids if self._sent is None else self._sent + ids
            self._sent_keys = keys
            self._note_sizes(sent)
        per_table: Dict[tuple, np.ndarray] = {}
        for key, peer in zip(keys, self._peer_of_key):
            self._add(per_table, key, "lengths", 0, int(peer), sent.stride() * sent.lengths().element_size())
        self._flush_bytes(per_table)

    def record_received(self, received: KeyedJaggedTensor, stride_per_rank: Optional[List[int]]) -> None:
        """The all-to-all's output: per key, one segment of bags from each peer."""
        n = len(self._peers)
        keys = received.keys()
        if not keys:
            return
        # bags per output segment (TorchRec's batch sizes are per rank; segments come in _received_from order)
        strides = [stride_per_rank[p] for p in self._received_from] if stride_per_rank else [received.stride() // n] * n
        ends = np.cumsum(np.tile(strides, len(keys)))
        cumulative = torch.cat(
            [received.lengths().new_zeros(1, dtype=torch.int64), torch.cumsum(received.lengths().long(), 0)]
        )
        bounds = torch.tensor(np.concatenate([[0], ends]), device=cumulative.device)
        ids = cumulative[bounds[1:]] - cumulative[bounds[:-1]]
        self._received = ids if self._received is None else self._received + ids
        self._received_keys = keys
        self._note_sizes(received)
        per_table: Dict[tuple, np.ndarray] = {}
        for key in keys:
            for segment, stride in enumerate(strides):
                self._add(
                    per_table,
                    key,
                    "lengths",
                    1,
                    self._received_from[segment],
                    stride * received.lengths().element_size(),
                )
        self._flush_bytes(per_table)

    def _note_sizes(self, kjt: KeyedJaggedTensor) -> None:
        weights = kjt.weights_or_none()
        self._id_bytes = kjt.values().element_size()
        self._weight_bytes = weights.element_size() if weights is not None else 0

    def flush(self) -> None:
        """Records the IDs (and weights) summed on the device since the last flush."""
        per_table: Dict[tuple, np.ndarray] = {}
        if self._sent is not None:
            for key, peer, n in zip(self._sent_keys, self._peer_of_key, self._sent.tolist()):
                self._add_ids(per_table, key, 0, int(peer), n)
        if self._received is not None:
            n_peers = len(self._peers)
            for i, n in enumerate(self._received.tolist()):
                self._add_ids(per_table, self._received_keys[i // n_peers], 1, self._received_from[i % n_peers], n)
        self._sent = self._received = None
        self._flush_bytes(per_table)

    def discard(self) -> None:
        self._sent = self._received = None

    def _add_ids(self, per_table: Dict[tuple, np.ndarray], key: str, direction: int, peer: int, ids: int) -> None:
        self._add(per_table, key, "ids", direction, peer, ids * self._id_bytes)
        if self._weight_bytes:
            self._add(per_table, key, "weights", direction, peer, ids * self._weight_bytes)

    def _add(
        self, per_table: Dict[tuple, np.ndarray], key: str, kind: str, direction: int, peer: int, nbytes: float
    ) -> None:
        table = self._feature_table[base_feature(key)]
        arr = per_table.setdefault((table, kind), np.zeros((2, self._stats.world_size)))
        arr[direction, self._peers[peer]] += nbytes

    def _flush_bytes(self, per_table: Dict[tuple, np.ndarray]) -> None:
        for (table, kind), arr in per_table.items():
            self._stats.record(self._sharding_type, table, kind, arr[0], arr[1])


class _PooledCounter:
    """What the pooled collectives' counters share: the group's members and the codecs. Messages go
    into a comm_stats.Ledger, which records them as embeddings and, reversed, as gradients."""

    def __init__(self, module: Any, stats: CommStats, sharding_type: str) -> None:
        self._stats, self._sharding_type = stats, sharding_type
        self._peers = group_ranks(collective_group(module))
        self._me = self._peers.index(stats.rank)
        codecs = collective_codecs(module)
        self._codecs = (codecs.forward, codecs.backward) if codecs is not None else (None, None)

    def _rows(self, local_embs: torch.Tensor, given: Optional[List[int]]) -> List[int]:
        """Rows per member: as given, or equal parts of the input."""
        n = len(self._peers)
        return list(given) if given else [local_embs.size(0) // n] * n

    def _record(self, ledger: Ledger, local_embs: torch.Tensor, rows: List[int]) -> None:
        """Both directions; the forward message each member gets is checked against the rows of
        `local_embs` it is handed (the gradients coming back are the same messages reversed,
        inside TorchRec's autograd function, out of our sight)."""
        sent = [r * local_embs.size(1) for r in rows]
        for backward, codec in ((False, self._codecs[0]), (True, self._codecs[1])):
            if codec is None:
                ledger.record(codec, backward, local_embs.element_size(), None if backward else sent)
                continue
            element = torch.empty(0, dtype=codec.quantized_dtype).element_size()
            encoded = [codec.calc_quantized_size(n, codec.create_context()) for n in sent]
            ledger.record(codec, backward, element, None if backward else encoded)


class PooledAllToAllCounter(_PooledCounter):
    """Counts one PooledEmbeddingsAllToAll: each rank's columns for each peer's samples; the
    gradients mirror them (recorded at forward time, see comm_stats)."""

    def __init__(
        self,
        a2a: PooledEmbeddingsAllToAll,
        stats: CommStats,
        sharding_type: str,
        table_widths_per_rank: List[Dict[str, List[int]]],
    ) -> None:
        super().__init__(a2a, stats, sharding_type)
        self._widths = table_widths_per_rank

    def __call__(self, module: PooledEmbeddingsAllToAll, args: Any, kwargs: Any) -> None:
        batch = self._rows(args[0], kwargs.get("batch_size_per_rank") or (args[1] if len(args) > 1 else None))
        ledger = Ledger(self._stats, self._sharding_type, self._peers)
        for i in range(len(self._peers)):
            ledger.add_columns(self._widths[self._me], i, False, batch[i])
            ledger.add_columns(self._widths[i], i, True, batch[self._me])
        self._record(ledger, args[0], batch)


class ReduceScatterCounter(_PooledCounter):
    """Counts one PooledEmbeddingsReduceScatter: rank i's chunk (its samples, every column) goes to
    i from every member; backward all-gathers each member's gradient chunk to every member."""

    def __call__(self, module: PooledEmbeddingsReduceScatter, args: Any, kwargs: Any) -> None:
        local_embs = args[0]
        rows = self._rows(local_embs, kwargs.get("input_splits") or (args[1] if len(args) > 1 else None))
        columns = {ALL_TABLES: [local_embs.size(1)]}
        ledger = Ledger(self._stats, self._sharding_type, self._peers)
        for i in range(len(self._peers)):
            ledger.add_columns(columns, i, False, rows[i])
            ledger.add_columns(columns, i, True, rows[self._me])
        self._record(ledger, local_embs, rows)


def table_widths_per_rank(sharding: Any, feature_table: Dict[str, str]) -> List[Dict[str, List[int]]]:
    """For a table-wise-like sharding: on each rank, the width of each output vector (one per feature and column
    shard) it holds per table."""
    out: List[Dict[str, List[int]]] = []
    for names, dims in zip(sharding.embedding_names_per_rank(), emb_dims_per_rank(sharding)):
        widths: Dict[str, List[int]] = {}
        for name, width in zip(names, dims):
            widths.setdefault(feature_table[base_feature(name)], []).append(int(width))
        out.append(widths)
    return out


def count_borrowed_dists(
    sharding: Any, dist_module: torch.nn.Module, stats: CommStats, sharding_type: str, feature_table: Dict[str, str]
) -> Optional[KJTCounter]:
    """Hooks the TorchRec collectives inside one of a sharding's dists (input or output); returns
    the KJT counter of an input dist, whose received side the caller records (KJTCounter).

    TorchRec's pooled output dists build their collective on first use; they are built here, as
    forward would for a fixed batch size, so that counting covers the first step too."""
    build_lazy_output_dists(dist_module)
    kjt_counter = None
    for m in dist_module.modules():
        if isinstance(m, KJTAllToAll):
            kjt_counter = KJTCounter(m, stats, sharding_type, feature_table)
            m.register_forward_hook(kjt_counter)
        elif isinstance(m, PooledEmbeddingsAllToAll):
            if has_emb_dims_per_rank(sharding) and len(group_ranks(collective_group(m))) == stats.world_size:
                widths = table_widths_per_rank(sharding, feature_table)
            else:  # table-row-wise's cross-node hop: every column of the sharding
                widths = [{ALL_TABLES: [d]} for d in pooled_dim_sum_per_rank(m)]
            m.register_forward_pre_hook(PooledAllToAllCounter(m, stats, sharding_type, widths), with_kwargs=True)
        elif isinstance(m, PooledEmbeddingsReduceScatter):
            m.register_forward_pre_hook(ReduceScatterCounter(m, stats, sharding_type), with_kwargs=True)
    return kjt_counter
