"""Sequence (unpooled) embeddings on our cluster types: grid (RB) and unique-based (UB) tables of a
TorchRec EmbeddingCollection, whose output is one vector per ID.

Both are siblings of the pooled shardings on their generic bases (grid.py's BaseGridEmbeddingSharding,
unique.py's BaseUniqueEmbeddingSharding and BaseUniqueEmbeddingDist), as TorchRec's sequence shardings are of
its pooled ones, and keep the same cells: each cell is a table-wise virtual feature, looked up by
TorchRec's fused sequence TBE (GroupedEmbeddingsLookup), so TorchRec's kernels and fused optimizers hold
the weights. A holder's lookup returns one row per ID it received, cell by
cell and, inside a cell, sender by sender; the output dists first reorder those rows sender by sender
(one segment permute, SegmentPermute) and send each sender its rows with our asynchronous all-to-all
(collectives.py, with the cluster's wire codecs).

- grid: the input dist cuts IDs by row bounds as the grid does, with fbgemm's bucketizer in sequence
  mode, which also says where each ID came from. An ID of a row-split table lives in exactly one row
  slice, whose cells hold its columns, so the rows that come back fill every (ID, column) of the
  output exactly once: the sender puts them in place with one gather (SequencePlacement), whose
  backward is one copy. Nothing is summed; a hierarchical layout runs flat (there are no partial sums
  to reduce inside a node).
- UB: UniqueSparseFeaturesDist sends each distinct ID once per holder; the pooled UB dist's exchange
  returns one vector per distinct ID, and the sender expands them into its sequence order with one
  index_select, whose backward sums the gradients per distinct ID before they travel.

Host work per step is a fixed number of tensor ops whatever the number of tables; the grid's sizes
come from TorchRec's split exchange (no extra host sync) unless one holder has cells of different
widths, which costs it one read of its per-cell ID counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingSharding,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import BaseEmbeddingLookup, BaseGroupedFeatureProcessor, ShardedEmbeddingTable
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .codecs import Segment
from .collectives import all_to_all
from .batch_state import BatchStateHandover
from .comm_stats import CountsComm, Ledger
from .grid import BaseGridEmbeddingSharding, CellRoute, GridSparseFeaturesDist, _ledger_hook
from .torchrec_compat import (
    add_grouping_key,
    emb_dims_per_rank,
    sharding_device,
    sharding_env,
    sharding_group,
    sharding_grouped_configs,
)
from .unique import BaseUniqueEmbeddingDist, BaseUniqueEmbeddingSharding, UniqueLayout, UniqueState
from .variable_batch import RowGather


class SegmentPermute(torch.autograd.Function):
    """A flat tensor's segments reordered: output segment i is input segment permute[i] (fbgemm's
    permute_1D_sparse_data); backward moves the gradient's segments back with the inverse."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, permute: torch.Tensor, inverse: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse, lengths.index_select(0, permute))
        _, out, _ = torch.ops.fbgemm.permute_1D_sparse_data(permute, lengths, x.contiguous(), None, x.numel())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        inverse, permuted = ctx.saved_tensors
        _, out, _ = torch.ops.fbgemm.permute_1D_sparse_data(inverse, permuted, grad.contiguous(), None, grad.numel())
        return out, None, None, None


class SenderMajor:
    """A holder's lookup output (cell by cell, each cell's rows sender by sender) laid out sender by
    sender, cell by cell, as the all-to-all sends it."""

    def __init__(self, widths: Sequence[int], senders: int, device: torch.device) -> None:
        cells = len(widths)
        order = [k * senders + s for s in range(senders) for k in range(cells)]
        self._permute = torch.tensor(order, dtype=torch.int32, device=device)
        self._inverse = torch.tensor(np.argsort(order), dtype=torch.int32, device=device)
        self._widths = torch.tensor(list(widths), dtype=torch.int64, device=device)

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`counts`: IDs per (cell, sender), [cells, senders], on the device."""
        lengths = (counts.long() * self._widths.unsqueeze(1)).reshape(-1)
        return SegmentPermute.apply(rows.reshape(-1), self._permute, self._inverse, lengths)


@dataclass
class SequencePlacement:
    """One batch's way home, worked out by the grid's input dist on the sending rank: the rows that
    come back (in the order the IDs were sent: holder by holder, cell by cell) as units of `unit`
    columns, and for each unit of the [ids, dim] output the received unit that fills it."""

    ids: int
    dim: int
    unit: int
    index: torch.Tensor
    recv: List[List[Segment]]  # per holder: its message, as (elements, row width) segments
    recv_rows: np.ndarray  # IDs sent per cell key, in send order (host)

    def __call__(self, received: torch.Tensor) -> torch.Tensor:
        return RowGather.apply(received.view(-1, self.unit), self.index).view(self.ids, self.dim)


class EmbarkSequenceContext(SequenceShardingContext):
    """TorchRec's sequence context plus what our output dists need from their batch's input dist
    (pipelined batches each carry their own): the grid's `placement`, or UB's `unique` and `received_counts`
    ([groups held here, senders]).  Built as UniqueShardingContext is, for TorchRec's contexts of either kind."""

    def __init__(
        self,
        placement: Optional[SequencePlacement] = None,
        unique: Optional[UniqueState] = None,
        received_counts: Optional[np.ndarray] = None,
        **torchrec_fields: Any,
    ) -> None:
        super().__init__(**torchrec_fields)
        self.placement = placement
        self.unique = unique
        self.received_counts = received_counts

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        tensors = [self.placement.index] if self.placement is not None else []
        if self.unique is not None:
            u = self.unique
            tensors += [t for t in (u.inverse, u.key_group, u.counts, u.lengths, u.weights) if t is not None]
        for t in tensors:
            t.record_stream(stream)


def ids_per_sender(lengths: torch.Tensor, batch_per_rank: List[int]) -> torch.Tensor:
    """IDs per (key, sender) from the bag lengths a holder received ([keys, sum of batches], each
    key's bags sender by sender)."""
    keys, senders = lengths.size(0), len(batch_per_rank)
    if len(set(batch_per_rank)) <= 1:
        return lengths.long().reshape(keys, senders, batch_per_rank[0]).sum(dim=2)
    ends = torch.tensor(np.cumsum(batch_per_rank), device=lengths.device)
    total = torch.nn.functional.pad(torch.cumsum(lengths.long(), dim=1), (1, 0))
    return total[:, ends] - total[:, ends - torch.tensor(batch_per_rank, device=lengths.device)]


class GridSequenceFeaturesDist(GridSparseFeaturesDist, BatchStateHandover[SequencePlacement]):
    """The grid's cut (GridSparseFeaturesDist's routing: row bounds, routes, KJT all-to-all) in
    sequence mode: besides each cell's IDs, where every ID sent came from, from which it works out
    the batch's SequencePlacement. Sequence features carry no weights."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        table_rows: List[int],
        row_bounds: List[List[int]],
        routes: List[CellRoute],
        virtual_names: List[str],
        features_per_rank: List[int],
        key_widths: List[int],
        dim: int,
        device: torch.device,
    ) -> None:
        super().__init__(
            pg,
            table_rows,
            [False] * len(row_bounds),
            row_bounds,
            routes,
            virtual_names,
            features_per_rank,
            False,
            device,
        )
        self._dim = dim
        self._unit = unit = math.gcd(dim, *key_widths)
        self._key_units = torch.tensor([w // unit for w in key_widths], dtype=torch.int64, device=device)
        self._key_col_units = torch.tensor([r.col_start // unit for r in routes], dtype=torch.int64, device=device)
        self._key_widths = np.asarray(key_widths, dtype=np.int64)
        # per holder: its keys, and its one row width (0: cells of several widths)
        bounds = np.concatenate([[0], np.cumsum(features_per_rank)]).astype(np.int64)
        self._holder_keys = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self._holder_width = [
            int(w[0]) if len(set(w.tolist())) == 1 else 0 for w in (self._key_widths[a:b] for a, b in self._holder_keys)
        ]

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        kjt = sparse_features
        stride = kjt.stride()
        lengths = kjt.lengths()
        ids = kjt.values().long()
        if self._buckets == 1:
            bucket_lengths, local = lengths, ids
            source = torch.arange(ids.numel(), device=ids.device)
        else:
            bucket_lengths, local, _, _, unbucketize = torch.ops.fbgemm.block_bucketize_sparse_features(
                lengths, ids, False, True, self._block_sizes, self._buckets, None, None, -1, self._bucket_pos
            )
            source = torch.ops.fbgemm.invert_permute(unbucketize.long())  # bucketized ID -> its input position
        rows = bucket_lengths.view(self._buckets * self._n_features, stride)
        out_lengths, out_values, _ = torch.ops.fbgemm.permute_2D_sparse_data(self._route_rows, rows, local, None, None)
        _, positions, _ = torch.ops.fbgemm.permute_2D_sparse_data(self._route_rows, rows, source, None, None)
        send = KeyedJaggedTensor(
            keys=self._virtual_names,
            values=out_values.to(torch.int32),
            lengths=out_lengths.reshape(-1).to(torch.int32),
            stride=stride,
        )
        awaitable = self._dist(send)  # TorchRec's split exchange has read each key's IDs onto the host
        self.last_state = self._placement(ids.numel(), positions, out_lengths, send.length_per_key())
        return awaitable

    def _placement(
        self, ids: int, positions: torch.Tensor, key_lengths: torch.Tensor, per_key: List[int]
    ) -> SequencePlacement:
        device = positions.device
        per_key_host = np.asarray(per_key, dtype=np.int64)
        sent = int(per_key_host.sum())
        key = torch.arange(len(per_key), device=device).repeat_interleave(
            key_lengths.sum(dim=1).long(), output_size=sent
        )
        units = self._key_units[key]
        n = ids * (self._dim // self._unit)  # every (ID, column) comes back exactly once
        value = torch.arange(sent, device=device).repeat_interleave(units, output_size=n)
        first = torch.cumsum(units, 0) - units
        offset = torch.arange(n, device=device) - first[value]
        dest = positions[value] * (self._dim // self._unit) + self._key_col_units[key][value] + offset
        index = torch.empty(n, dtype=torch.int64, device=device).index_copy_(0, dest, torch.arange(n, device=device))
        recv: List[List[Segment]] = []
        for (a, b), width in zip(self._holder_keys, self._holder_width):
            if width:
                recv.append([(int(per_key_host[a:b].sum()) * width, width)])
            else:
                recv.append([(int(r) * int(w), int(w)) for r, w in zip(per_key_host[a:b], self._key_widths[a:b])])
        return SequencePlacement(ids, self._dim, self._unit, index, recv, per_key_host)


class GridSequenceEmbeddingDist(BaseEmbeddingDist[EmbarkSequenceContext, torch.Tensor, torch.Tensor], CountsComm):
    """Sends each sender the rows of its IDs (started here, waited where TorchRec waits the module's
    output); the sender puts them in place (SequencePlacement)."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        widths_per_rank: List[List[int]],
        tables_per_rank: List[List[str]],
        device: torch.device,
        codecs: Optional[QuantizedCommCodecs] = None,
    ) -> None:
        super().__init__()
        self._pg, self._codecs = pg, codecs
        self._world, self._rank = dist.get_world_size(pg), dist.get_rank(pg)
        mine = widths_per_rank[self._rank]
        self._widths = np.asarray(mine, dtype=np.int64)
        self._width = mine[0] if len(set(mine)) == 1 else 0  # 0: my cells have several widths
        self._sender_major = SenderMajor(mine, self._world, device)
        self._table_names = list(dict.fromkeys(t for tables in tables_per_rank for t in tables))
        index = {t: i for i, t in enumerate(self._table_names)}
        self._key_tables = [np.asarray([index[t] for t in tables], dtype=np.int64) for tables in tables_per_rank]
        self._key_widths = [np.asarray(w, dtype=np.int64) for w in widths_per_rank]

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: Optional[EmbarkSequenceContext] = None
    ) -> Awaitable[torch.Tensor]:
        if sharding_ctx is None or sharding_ctx.placement is None or sharding_ctx.lengths_after_input_dist is None:
            raise RuntimeError(
                "GridSequenceEmbeddingDist needs its batch's EmbarkSequenceContext (set by the sharded EC)"
            )
        placement = sharding_ctx.placement
        lengths = sharding_ctx.lengths_after_input_dist
        batch = list(sharding_ctx.batch_size_per_rank) or [lengths.size(1) // self._world] * self._world
        counts = ids_per_sender(lengths, batch)
        payload = self._sender_major(local_embs, counts)
        host_counts = None
        if not self._width or self.comm_stats is not None:  # per cell: one host read
            host_counts = np.asarray(counts.tolist(), dtype=np.int64).reshape(len(self._widths), self._world)
        if self._width:
            send = [[(int(n) * self._width, self._width)] for n in sharding_ctx.output_splits]
        else:
            assert host_counts is not None
            send = [
                [(int(n) * int(w), int(w)) for n, w in zip(host_counts[:, s], self._widths)] for s in range(self._world)
            ]
        ledger = self._ledger(host_counts, placement.recv_rows) if host_counts is not None else None
        awaitable = all_to_all(
            payload, send, placement.recv, self._pg, self._codecs, self._world, _ledger_hook(ledger, self._codecs)
        )
        awaitable.callbacks.append(placement)
        return awaitable

    def _ledger(self, sent_rows: np.ndarray, recv_rows: np.ndarray) -> Optional[Ledger]:
        """Rows each way, per table and peer: what I send per cell and sender, what comes back per
        cell key I sent (None when not counting)."""
        if self.comm_stats is None:
            return None
        ledger = Ledger(self.comm_stats, self.comm_sharding_type, list(range(self._world)))
        cells = len(self._widths)
        rows = sent_rows.reshape(-1)
        ledger.add_many(
            self._table_names,
            np.repeat(self._key_tables[self._rank], self._world),
            np.tile(np.arange(self._world), cells),
            False,
            rows * np.repeat(self._widths, self._world),
            rows,
        )
        holder = np.repeat(np.arange(self._world), [len(t) for t in self._key_tables])
        ledger.add_many(
            self._table_names,
            np.concatenate(self._key_tables),
            holder,
            True,
            recv_rows * np.concatenate(self._key_widths),
            recv_rows,
        )
        return ledger


def by_cell_width(tables_per_rank: List[List[ShardedEmbeddingTable]]) -> List[List[ShardedEmbeddingTable]]:
    """The cells grouped into one TBE per width: a sequence TBE takes a single row width."""
    for tables in tables_per_rank:
        for table in tables:
            add_grouping_key(table, table.local_cols)
    return tables_per_rank


def sequence_lookup(sharding: EmbeddingSharding, device: Optional[torch.device]) -> BaseEmbeddingLookup:
    """TorchRec's sequence (unpooled) lookup over a sharding's cells, as its sequence shardings build it."""
    return GroupedEmbeddingsLookup(
        grouped_configs=sharding_grouped_configs(sharding),
        pg=sharding_group(sharding),
        device=device if device is not None else sharding_device(sharding),
        env=sharding_env(sharding),
    )


class GridSequenceEmbeddingSharding(BaseGridEmbeddingSharding[EmbarkSequenceContext]):
    """Embark's RB cluster for sequence tables: the grid's cells, looked up unpooled (module docstring); a
    sibling of the pooled GridPooledEmbeddingSharding on their common base."""

    def _shard(self, sharding_infos: List[EmbeddingShardingInfo]) -> List[List[ShardedEmbeddingTable]]:
        return by_cell_width(super()._shard(sharding_infos))

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BaseEmbeddingLookup:
        return sequence_lookup(self, device)

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        pg = self.dist_group()
        virtual = [v for names in self.feature_names_per_rank() for v in names]
        return GridSequenceFeaturesDist(
            pg,
            self._feature_rows,
            self._feature_bounds,
            [self._cells[v] for v in virtual],
            virtual,
            self.features_per_rank(),
            [w for widths in emb_dims_per_rank(self) for w in widths],
            self._sequence_dim(),
            self.dist_device(device),
        )

    def create_output_dist(  # type: ignore[override]
        self, device: Optional[torch.device] = None
    ) -> GridSequenceEmbeddingDist:
        pg = self.dist_group()
        tables = [
            [self._feature_tables[self._cells[v].feature] for v in names] for names in self.feature_names_per_rank()
        ]
        return GridSequenceEmbeddingDist(
            pg, emb_dims_per_rank(self), tables, self.dist_device(device), self.wire_codecs()
        )

    def _sequence_dim(self) -> int:
        dims = set(self._feature_dims)
        if len(dims) != 1:
            raise ValueError(f"sequence tables of one sharding must share one dim, got {sorted(dims)}")
        return dims.pop()


class UniqueSequenceEmbeddingDist(BaseUniqueEmbeddingDist[EmbarkSequenceContext]):
    """The UB dist for sequence tables: the exchange of distinct vectors the pooled one has too (their common
    base); the holder's lookup output is laid out sender by sender first, and the sender expands the distinct
    vectors into its sequence order (one row per ID) instead of pooling them."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        layout: UniqueLayout,
        tables: List[str],
        device: torch.device,
        codecs: Optional[QuantizedCommCodecs] = None,
    ) -> None:
        super().__init__(pg, layout, tables, device, codecs)
        self._layout_rows = SenderMajor(layout.cell_widths_on[self._rank], self._world, device)

    def _sender_major(self, padded: torch.Tensor, per_cell: np.ndarray) -> torch.Tensor:
        """TorchRec's EC hands the sequence lookup's output (one row per ID received, cell by cell,
        sender by sender within a cell) as a 2-D view; `per_cell`: [cells, senders] IDs."""
        return self._layout_rows(padded, torch.from_numpy(per_cell).to(self._device))

    def _expand(self, vectors: torch.Tensor, state: UniqueState) -> torch.Tensor:
        table, index = self._table(vectors, state)
        return table.index_select(0, index)


class UniqueSequenceEmbeddingSharding(BaseUniqueEmbeddingSharding[EmbarkSequenceContext]):
    """Embark's UB cluster for sequence tables: the UB cells and input dist, looked up unpooled; a sibling of
    the pooled UniquePooledEmbeddingSharding on their common base."""

    def _shard(self, sharding_infos: List[EmbeddingShardingInfo]) -> List[List[ShardedEmbeddingTable]]:
        return by_cell_width(super()._shard(sharding_infos))

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BaseEmbeddingLookup:
        return sequence_lookup(self, device)

    def create_output_dist(  # type: ignore[override]
        self, device: Optional[torch.device] = None
    ) -> UniqueSequenceEmbeddingDist:
        pg = self.dist_group()
        return UniqueSequenceEmbeddingDist(
            pg, self.unique_layout(), self._feature_tables, self.dist_device(device), self.wire_codecs()
        )
