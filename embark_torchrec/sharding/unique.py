"""Unique-based (UB) cluster: each distinct ID travels once, and one vector per distinct ID comes back.

The table's cells are table-wise virtual features as in grid.py, so TorchRec's fused lookup and
optimizers hold the weights; only the dists differ. A "group" is one (feature, row slice); its
holders are the ranks holding cells of that row slice.

- input dist (UniqueSparseFeaturesDist): one torch.unique over all the group's features (IDs
  offset per feature) gives each group's distinct row-local IDs; they go to each holder through
  TorchRec's KJTAllToAll as one bag per (holder, group) key, so the counts ride the module's split
  exchange (input_exchange.py);
- lookup (unique_lookup_input): the holder looks every received ID up as a bag of one with
  TorchRec's lookup in variable-batch mode (one "batch" per sender and cell), whose output is
  already laid out sender by sender, as the output all-to-all sends it;
- output dist (UniquePooledEmbeddingDist): an asynchronous all-to-all (collectives.py) returns each
  sender its distinct vectors; one embedding_bag over all features expands them into the bags
  (sum, with per-ID weights: the feature's weights times 1 / bag length for MEAN), taken sample by
  sample so that the output needs no transposing copy. When every cell is a whole row slice of one
  width the vectors are already rows of one table, and each ID's row is its distinct key's index
  shifted by where its group's block arrives (computed on the host from the counts). Backward,
  the gradients are summed per distinct ID, and one gradient row per distinct ID travels back to
  its holder.

BaseUniqueEmbeddingSharding (the layout and the input dist) and BaseUniqueEmbeddingDist (the exchange of
distinct vectors) are the generic bases of the pooled classes here and the sequence ones (sequence.py), which
differ in the lookup and in how the sender expands the vectors.

Host work per step is a fixed number of tensor ops and three host syncs more than TorchRec's
table-wise (the unique, its counts, the counts received; 6 against 3 per training step at 2 ranks in
benchmarks/host_overhead.py), whatever the number of tables. What the output dist needs from its batch's
input dist travels in that batch's context (UniqueShardingContext), so pipelined batches never mix.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist, EmbeddingShardingContext
from torchrec.distributed.embedding_types import BaseEmbeddingLookup, BaseGroupedFeatureProcessor
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .codecs import Segment
from .collectives import all_to_all
from .batch_state import BatchStateHandover
from .comm_stats import CountsComm, Ledger
from .torchrec_compat import VARIABLE_BATCH_OPTIMIZERS, emb_dims_per_rank, supports_variable_batch
from .grid import BaseGridEmbeddingSharding, CellRoute, _ledger_hook, bag_weights, pooled_lookup
from .variable_batch import FeatureMajor, RowGather, pad_to_uniform

# the largest key space whose keys (IDs offset per feature and row slice) de-duplicate as int32
KEY_INT32_LIMIT = 2**31 - 1


def key_dtype(key_space: int) -> torch.dtype:
    """The dtype UB's de-duplication sorts keys in: int32 where every key fits (sorting them takes half
    the time of int64 keys, on CPUs and GPUs), int64 beyond."""
    return torch.int32 if key_space <= KEY_INT32_LIMIT else torch.int64


# how a UB holder looks up the distinct IDs it receives (EmbarkEmbeddingBagCollectionSharder's unique_lookup)
UNIQUE_LOOKUPS = ("auto", "variable_batch", "padded")


@dataclass
class UniqueState:
    """One batch's de-duplication on the sending rank, as its input dist leaves it."""

    stride: int
    inverse: torch.Tensor  # per ID of the batch: its index among the distinct (feature, ID) keys
    key_group: torch.Tensor  # per distinct key: its group
    counts: torch.Tensor  # distinct keys per group (device, int32)
    group_counts: List[int]  # the same, on the host
    lengths: torch.Tensor  # the batch's bag lengths, [features x stride]
    weights: Optional[torch.Tensor]  # per-ID weights for the expansion (None: all 1)


class UniqueShardingContext(EmbeddingShardingContext):
    """TorchRec's sharding context plus the batch's de-duplication (`unique`) and the IDs each sender's message
    held (`received_counts`, [groups held here, senders]).  TorchRec's contexts are plain classes with keyword
    constructors in 1.6 and dataclasses from 1.7: handing TorchRec's fields to super() by keyword serves both."""

    def __init__(
        self,
        unique: Optional[UniqueState] = None,
        received_counts: Optional[np.ndarray] = None,
        **torchrec_fields: Any,
    ) -> None:
        super().__init__(**torchrec_fields)
        self.unique = unique
        self.received_counts = received_counts


@dataclass(frozen=True)
class UniqueLayout:
    """The static routing of one UB sharding: groups, who holds them, and each rank's cells.

    Group g = (feature f, row slice r), numbered feature-major; its keys are the IDs of f in r
    offset by key_start[g], so one sorted torch.unique over all features orders IDs by group.
    """

    features: List[str]  # the embedding names (unique per table and feature)
    dims: List[int]
    group_feature: List[int]
    group_names: List[str]
    key_start: List[int]  # first key of each group (+ one past the last)
    groups_on: List[List[int]]  # per rank: the groups it holds cells of, ascending
    cells_on: List[List[CellRoute]]  # per rank: its cells, in lookup order
    cell_widths_on: List[List[int]]
    cell_group_on: List[List[int]]  # per rank, per cell: its group

    @classmethod
    def build(
        cls,
        features: List[str],
        dims: List[int],
        rows: List[int],
        row_bounds: List[List[int]],
        cells_on: List[List[CellRoute]],
        cell_widths_on: List[List[int]],
    ) -> "UniqueLayout":
        group_feature, group_names, key_start, first_group = [], [], [], []
        offset = 0
        for f, bounds in enumerate(row_bounds):
            first_group.append(len(group_feature))
            for r, start in enumerate(bounds[:-1]):
                group_feature.append(f)
                group_names.append(f"{features[f]}#{r}")
                key_start.append(offset + start)
            offset += rows[f]
        key_start.append(offset)
        cell_group_on = [[first_group[c.feature] + c.row_slice for c in cells] for cells in cells_on]
        return cls(
            features=features,
            dims=dims,
            group_feature=group_feature,
            group_names=group_names,
            key_start=key_start,
            groups_on=[sorted(set(g)) for g in cell_group_on],
            cells_on=cells_on,
            cell_widths_on=cell_widths_on,
            cell_group_on=cell_group_on,
        )

    @property
    def num_groups(self) -> int:
        return len(self.group_feature)

    def full_width(self) -> bool:
        """Every cell holds a whole row slice of one common width, once: the received vectors are
        then rows of one table, and the expansion needs no scatter."""
        widths = {w for ws in self.cell_widths_on for w in ws} | set(self.dims)
        cells = [g for groups in self.cell_group_on for g in groups]
        return len(widths) == 1 and sorted(cells) == list(range(self.num_groups))


class UniqueSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor], BatchStateHandover[UniqueState]):
    """De-duplicates per (feature, row slice) and sends each distinct ID once per holder."""

    def __init__(
        self, pg: dist.ProcessGroup, layout: UniqueLayout, weighted: bool, mean: List[bool], device: torch.device
    ) -> None:
        super().__init__()
        self._layout = layout
        self._weighted = weighted or any(mean)
        self._mean = torch.tensor(mean, device=device)
        self._key_dtype = key_dtype(layout.key_start[-1])
        self._key_start = torch.tensor(layout.key_start, dtype=self._key_dtype, device=device)
        self._group_bounds = torch.tensor(  # each group's first and end key
            [layout.key_start[:-1], layout.key_start[1:]], dtype=self._key_dtype, device=device
        )
        first_group = [layout.group_feature.index(f) for f in range(len(layout.features))]
        self._feature_key_start = torch.tensor(
            [layout.key_start[g] for g in first_group], dtype=self._key_dtype, device=device
        )
        self._bag_key_start: Dict[int, torch.Tensor] = {}  # per batch size: each bag's feature's first key
        send_groups = [g for groups in layout.groups_on for g in groups]
        self._send_names = [layout.group_names[g] for g in send_groups]
        self._send_groups_host = np.asarray(send_groups, dtype=np.int64)
        self._send_in_group_order = send_groups == list(range(layout.num_groups))
        self._send_groups = torch.tensor(send_groups, dtype=torch.int32, device=device)
        self._dist = KJTAllToAll(pg=pg, splits=[len(g) for g in layout.groups_on])

    def _bag_offsets(self, stride: int) -> torch.Tensor:
        """Each bag's key offset (its feature's first key), for `stride` bags per feature; built once
        per batch size, so that a step needs no host-to-device copy of the per-feature IDs."""
        offsets = self._bag_key_start.get(stride)
        if offsets is None:
            offsets = self._bag_key_start[stride] = self._feature_key_start.repeat_interleave(stride)
        return offsets

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        kjt = pad_to_uniform(sparse_features)
        stride = kjt.stride()
        lengths = kjt.lengths()
        ids = kjt.values().to(self._key_dtype)
        offset = self._bag_offsets(stride).repeat_interleave(lengths, output_size=ids.numel())
        keys, inverse = torch.unique(ids + offset, sorted=True, return_inverse=True)
        first, end = torch.searchsorted(keys, self._group_bounds, out_int32=True).unbind()
        counts = end - first
        key_group = torch.repeat_interleave(counts, output_size=keys.numel())  # (group g repeated counts[g] times)
        local_ids = (keys - self._key_start[key_group]).to(torch.int32)
        group_counts: List[int] = counts.tolist()
        # the per-key lengths are known here: TorchRec's all-to-all need not read them off the device again
        per_key = np.asarray(group_counts, dtype=np.int64)[self._send_groups_host].tolist()
        if self._send_in_group_order:
            send_lengths, send_values = counts, local_ids
        else:
            send_lengths, send_values, _ = torch.ops.fbgemm.permute_1D_sparse_data(
                self._send_groups, counts, local_ids, None, sum(per_key)
            )
        weights = bag_weights(kjt, self._mean) if self._weighted else None
        self.last_state = UniqueState(stride, inverse, key_group, counts, group_counts, lengths, weights)
        send = KeyedJaggedTensor(
            keys=self._send_names,
            values=send_values,
            lengths=send_lengths,
            stride=1,
            length_per_key=per_key,
            stride_per_key=[1] * len(per_key),
        )
        return self._dist(send)


def unique_lookup_input(
    received: KeyedJaggedTensor, layout: UniqueLayout, rank: int, cell_names: List[str], variable_batch: bool
) -> tuple[KeyedJaggedTensor, np.ndarray]:
    """The holder's lookup input from the received distinct IDs (keys: its groups; one bag per
    sender): every ID a bag of one, per cell. With `variable_batch` (the TBE's optimizer allows
    it), one batch per (cell, sender), so that the lookup's output is laid out sender by sender;
    otherwise one batch as long as the longest cell's IDs, padded with empty bags (the output dist
    then gathers the rows). Also returns the IDs received per (group held here, sender)."""
    world = len(layout.groups_on)
    mine = layout.groups_on[rank]
    counts = np.asarray(received.lengths().tolist(), dtype=np.int64).reshape(len(mine), world)
    position = {g: i for i, g in enumerate(mine)}
    cell_pos = [position[g] for g in layout.cell_group_on[rank]]
    per_cell = counts[cell_pos]  # [cells, senders]
    cell_sizes = per_cell.sum(axis=1)
    values = received.values()
    if cell_pos != list(range(len(mine))):  # cells that share a group repeat its IDs
        group_start = np.concatenate([[0], np.cumsum(counts.sum(axis=1))])
        cell_start = np.concatenate([[0], np.cumsum(cell_sizes)])[:-1]
        shift = torch.tensor(group_start[cell_pos] - cell_start, device=values.device)
        total = int(cell_sizes.sum())
        sizes = torch.tensor(cell_sizes, device=values.device)
        values = values[torch.arange(total, device=values.device) + shift.repeat_interleave(sizes, output_size=total)]
    sizes_host = cell_sizes.tolist()
    if variable_batch:
        kjt = KeyedJaggedTensor(
            keys=cell_names,
            values=values,
            lengths=torch.ones(values.numel(), dtype=torch.int64, device=values.device),
            stride_per_key_per_rank=per_cell.tolist(),
            stride=max(sizes_host, default=0),
            stride_per_key=sizes_host,
            length_per_key=sizes_host,
        )
        return kjt, counts
    stride = max(1, int(cell_sizes.max())) if len(cell_sizes) else 1
    # int64 lengths give the int64 offsets the TBE takes, and the host knows every cell's IDs
    padded = (np.arange(stride)[None, :] < cell_sizes[:, None]).reshape(-1)
    lengths = torch.as_tensor(padded.astype(np.int64), device=values.device)
    kjt = KeyedJaggedTensor(keys=cell_names, values=values, lengths=lengths, stride=stride, length_per_key=sizes_host)
    return kjt, counts


def _element_blocks(elems: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `n` elements laid out as consecutive blocks of `elems[b]` elements: each element's block
    and its offset inside it."""
    block = torch.arange(elems.numel(), device=elems.device).repeat_interleave(elems, output_size=n)
    return block, torch.arange(n, device=elems.device) - (torch.cumsum(elems, 0) - elems)[block]


class _BagSum(torch.autograd.Function):
    """Each bag's sum of its IDs' rows of `table` (times their weights), by embedding_bag; backward
    gathers each ID's bag gradient and scatter-adds it into its row (embedding_bag's own dense
    backward sorts the IDs first and is several times slower on CPU). The table's rows are the
    batch's distinct IDs, so with as many IDs as rows (none repeats; known from sizes alone) each
    row's gradient is its one ID's bag gradient: one gather."""

    @staticmethod
    def forward(
        ctx: Any, table: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index, lengths, weights)
        ctx.rows = table.size(0)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.long())
        # embedding_bag takes weights of the table's dtype only; a batch's may be float64 (as TorchRec's types take)
        per_id = None if weights is None else weights.to(table.dtype)
        return F.embedding_bag(index, table, offsets, mode="sum", per_sample_weights=per_id, include_last_offset=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        index, lengths, weights = ctx.saved_tensors
        grad = grad.contiguous()  # index_select of a strided gradient (e.g. a sum's, expanded) is far slower
        bags = torch.repeat_interleave(lengths, output_size=index.numel())  # each ID's bag
        if index.numel() == ctx.rows:  # each row's one ID: its bag, its weight
            rows = grad.index_select(0, bags.new_empty(ctx.rows).index_copy_(0, index, bags))
            if weights is not None:
                rows = rows * weights.new_empty(ctx.rows).index_copy_(0, index, weights).unsqueeze(1).to(rows.dtype)
            return rows, None, None, None
        per_id = grad.index_select(0, bags)
        if weights is not None:
            per_id = per_id * weights.unsqueeze(1).to(per_id.dtype)
        return grad.new_zeros(ctx.rows, grad.size(1)).index_add_(0, index, per_id), None, None, None


C = TypeVar(
    "C", bound=EmbeddingShardingContext
)  # UniqueShardingContext, sequence.EmbarkSequenceContext: both carry the unique state


class BaseUniqueEmbeddingDist(BaseEmbeddingDist[C, torch.Tensor, torch.Tensor], CountsComm):
    """Sends each sender the vectors of its distinct IDs, which the sender then expands (`_expand`): into its
    bags (UniquePooledEmbeddingDist) or one row per ID (sequence.UniqueSequenceEmbeddingDist). The generic
    base of the two; a holder's padded lookup output comes in each one's own layout (`_sender_major`)."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        layout: UniqueLayout,
        tables: List[str],
        device: torch.device,
        codecs: Optional[QuantizedCommCodecs] = None,
    ) -> None:
        super().__init__()
        self._pg, self._layout, self._codecs = pg, layout, codecs
        self._rank, self._world = dist.get_rank(pg), dist.get_world_size(pg)
        me, world = self._rank, self._world
        position = {g: i for i, g in enumerate(layout.groups_on[me])}
        self._cell_pos = np.asarray([position[g] for g in layout.cell_group_on[me]], dtype=np.int64)
        self._cell_widths = np.asarray(layout.cell_widths_on[me], dtype=np.int64)
        self._full_width = layout.full_width()
        self._device = device
        self._feature_major = FeatureMajor(layout.dims, device)
        self._width = layout.dims[0] if layout.dims else 0
        # received blocks, in arrival order (holder, then its cells): group, width, first column
        blocks = [
            (g, w, c.col_start)
            for k in range(world)
            for g, w, c in zip(layout.cell_group_on[k], layout.cell_widths_on[k], layout.cells_on[k])
        ]
        self._block_group = torch.tensor([b[0] for b in blocks], dtype=torch.int64, device=device)
        self._block_width = torch.tensor([b[1] for b in blocks], dtype=torch.int64, device=device)
        self._block_col = torch.tensor([b[2] for b in blocks], dtype=torch.int64, device=device)
        self._max_dim = max(layout.dims) if layout.dims else 0
        # counting: the table of each cell of mine and of each block I receive
        table_index = {t: i for i, t in enumerate(dict.fromkeys(tables))}
        self._tables = list(table_index)
        feature_table = [table_index[tables[f]] for f in range(len(layout.features))]
        self._cell_table = np.asarray(
            [feature_table[layout.group_feature[g]] for g in layout.cell_group_on[me]], dtype=np.int64
        )
        self._block_table = np.asarray([feature_table[layout.group_feature[b[0]]] for b in blocks], dtype=np.int64)
        self._block_rank = np.asarray([k for k in range(world) for _ in layout.cell_group_on[k]], dtype=np.int64)
        self._block_group_host = np.asarray([b[0] for b in blocks], dtype=np.int64)
        self._block_width_host = np.asarray([b[1] for b in blocks], dtype=np.int64)

    def _segments(self, rows: np.ndarray, widths: np.ndarray, member: np.ndarray) -> List[List[Segment]]:
        """Per member, its message as (elements, width) segments: one per width present."""
        segments: List[List[Segment]] = [[] for _ in range(self._world)]
        if len(set(widths.tolist())) <= 1:
            elems = np.bincount(member, weights=rows * widths, minlength=self._world).astype(np.int64)
            w = int(widths[0]) if len(widths) else 1
            return [[(int(e), w)] for e in elems]
        for m, r, w in zip(member.tolist(), rows.tolist(), widths.tolist()):
            segments[m].append((r * w, w))
        return segments

    def forward(self, local_embs: torch.Tensor, sharding_ctx: Optional[C] = None) -> Awaitable[torch.Tensor]:
        state: Optional[UniqueState] = getattr(sharding_ctx, "unique", None)
        received: Optional[np.ndarray] = getattr(sharding_ctx, "received_counts", None)
        if sharding_ctx is None or state is None or received is None:
            raise RuntimeError(
                f"{type(self).__name__} needs its batch's context with the unique state (set by the sharded module)"
            )
        world = self._world
        # what I send: per sender, per cell of mine, its distinct IDs' vectors (the lookup's order)
        per_cell = received[self._cell_pos]  # [cells, senders]
        cells = len(self._cell_pos)
        send = self._segments(
            per_cell.T.reshape(-1), np.tile(self._cell_widths, world), np.repeat(np.arange(world), cells)
        )
        # what I receive: per holder, per cell of its, the vectors of my distinct IDs
        counts = np.asarray(state.group_counts, dtype=np.int64)
        recv = self._segments(counts[self._block_group_host], self._block_width_host, self._block_rank)
        ledger = self._ledger(per_cell, counts) if self.comm_stats is not None else None
        if local_embs.dim() == 2:  # a padded lookup (see unique_lookup_input); the variable-batch one is flat
            local_embs = self._sender_major(local_embs, per_cell)
        awaitable = all_to_all(
            local_embs, send, recv, self._pg, self._codecs, world, _ledger_hook(ledger, self._codecs)
        )
        awaitable.callbacks.append(lambda vectors: self._expand(vectors, state))
        if sharding_ctx.variable_batch_per_feature:
            awaitable.callbacks.append(self._feature_major)
        return awaitable

    @abc.abstractmethod
    def _sender_major(self, padded: torch.Tensor, per_cell: np.ndarray) -> torch.Tensor:
        """A padded lookup's output as the exchange sends it: sender by sender, cell by cell, row by row;
        `per_cell`: [cells, senders] IDs received."""

    @abc.abstractmethod
    def _expand(self, vectors: torch.Tensor, state: UniqueState) -> torch.Tensor:
        """The sender's output from the distinct vectors that came back."""

    def _table(self, vectors: torch.Tensor, state: UniqueState) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct vectors as the rows of one table, and each batch ID's row in it."""
        if self._full_width:  # the vectors are rows already, block by block: shift each key's row
            # by where its group's block starts (from the host counts: a handful of ops, no scatter)
            counts = np.asarray(state.group_counts, dtype=np.int64)
            block_rows = counts[self._block_group_host]
            shift = np.empty_like(counts)
            shift[self._block_group_host] = np.cumsum(block_rows) - block_rows
            shift -= np.cumsum(counts) - counts
            # (non-blocking: a pageable host buffer is staged at once, the host does not wait on the device)
            key_shift = torch.from_numpy(shift).to(state.inverse.device, non_blocking=True)[state.key_group]
            return vectors.view(-1, self._width), state.inverse + key_shift[state.inverse]
        # otherwise scatter every received element into a [keys, widest dim] table
        counts = state.counts
        group_first_key = torch.cumsum(counts, 0) - counts
        block_rows = counts[self._block_group]
        block, offset = _element_blocks(block_rows * self._block_width, vectors.numel())
        width = self._block_width[block]
        row = group_first_key[self._block_group][block] + torch.div(offset, width, rounding_mode="floor")
        dest = row * self._max_dim + self._block_col[block] + torch.remainder(offset, width)
        keys = state.key_group.numel()
        table = vectors.new_zeros(keys * self._max_dim).index_copy(0, dest, vectors)
        return table.view(keys, self._max_dim), state.inverse

    def _ledger(self, per_cell: np.ndarray, counts: np.ndarray) -> Ledger:
        """Vectors each way, per table and peer: what I send per cell and sender, what I receive per block."""
        assert self.comm_stats is not None
        ledger = Ledger(self.comm_stats, self.comm_sharding_type, list(range(self._world)))
        world = self._world
        cells = len(self._cell_pos)
        rows = per_cell.reshape(-1)
        ledger.add_many(
            self._tables,
            np.repeat(self._cell_table, world),
            np.tile(np.arange(world), cells),
            False,
            rows * np.repeat(self._cell_widths, world),
            rows,
        )
        block_rows = counts[self._block_group_host]
        ledger.add_many(
            self._tables, self._block_table, self._block_rank, True, block_rows * self._block_width_host, block_rows
        )
        return ledger


class UniquePooledEmbeddingDist(BaseUniqueEmbeddingDist[UniqueShardingContext]):
    """The UB dist for pooled tables: the sender pools the distinct vectors into its bags (module docstring)."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        layout: UniqueLayout,
        tables: List[str],
        device: torch.device,
        codecs: Optional[QuantizedCommCodecs] = None,
    ) -> None:
        super().__init__(pg, layout, tables, device, codecs)
        self._bag_orders: Dict[int, torch.Tensor] = {}  # per batch size: the bags' sample-major order
        self._num_features = len(layout.features)
        self._columns = torch.tensor(
            [f * self._max_dim + j for f, d in enumerate(layout.dims) for j in range(d)],
            dtype=torch.int64,
            device=device,
        )
        self._same_dims = len(set(layout.dims)) <= 1

    def _sender_major(self, padded: torch.Tensor, per_cell: np.ndarray) -> torch.Tensor:
        """A padded lookup's output ([longest cell, my width]; cell c's IDs from sender s in rows
        first_row[c, s] onwards of its columns) gathered into the variable-batch layout: sender by
        sender, cell by cell, row by row. With one width for all my cells, whole rows are gathered;
        otherwise single elements."""
        cells, world = per_cell.shape
        first_row = (np.cumsum(per_cell, axis=1) - per_cell).T.reshape(-1)  # per (sender, cell)
        rows = per_cell.T.reshape(-1)
        out_start = np.cumsum(rows) - rows
        device = padded.device
        if len(set(self._cell_widths.tolist())) == 1:  # (the padded lookup runs on CPUs: the index is built there)
            cell = np.tile(np.arange(cells), world)
            base = first_row * cells + cell - out_start * cells
            n = int(rows.sum())
            index = np.repeat(base, rows) + np.arange(n) * cells
            rows_of = padded.reshape(-1, int(self._cell_widths[0]))
            index_t = torch.from_numpy(index).to(device, non_blocking=True)
            if not n:
                return RowGather.apply(rows_of, index_t).reshape(-1)
            # backward gathers: the padding rows, empty bags, take row 0's gradient, which the lookup never reads
            inverse = np.zeros(rows_of.size(0), dtype=np.int64)
            inverse[index] = np.arange(n)
            inverse_t = torch.from_numpy(inverse).to(device, non_blocking=True)
            return RowGather.apply(rows_of, index_t, inverse_t).reshape(-1)
        widths = np.tile(self._cell_widths, world)
        columns = np.tile(np.concatenate([[0], np.cumsum(self._cell_widths)])[:-1], world)
        elems = rows * widths
        n = int(elems.sum())
        block, offset = _element_blocks(torch.tensor(elems, device=device), n)
        width = torch.tensor(widths, device=device)[block]
        row = torch.tensor(first_row, device=device)[block] + torch.div(offset, width, rounding_mode="floor")
        source = row * padded.size(1) + torch.tensor(columns, device=device)[block] + torch.remainder(offset, width)
        return padded.reshape(-1)[source]

    def _sample_major(self, stride: int) -> torch.Tensor:
        """The bags in sample-major order (bag s * features + f is feature-major bag f * stride + s),
        built once per batch size: pooling them in this order gives the [stride, features x width]
        output without a transposing copy (and its gradient arrives contiguous)."""
        order = self._bag_orders.get(stride)
        if order is None:
            bags = torch.arange(self._num_features * stride, dtype=torch.int32, device=self._device)
            order = self._bag_orders[stride] = bags.view(self._num_features, stride).t().reshape(-1)
        return order

    def _expand(self, vectors: torch.Tensor, state: UniqueState) -> torch.Tensor:
        table, index = self._table(vectors, state)
        stride = state.stride
        lengths, index, weights = torch.ops.fbgemm.permute_1D_sparse_data(
            self._sample_major(stride), state.lengths, index, state.weights, index.numel()
        )
        # also when this rank has no IDs: the output must depend on `vectors`, so that this rank
        # joins the backward exchange
        pooled = _BagSum.apply(table, index, lengths, weights)
        out = pooled.view(stride, self._num_features * pooled.size(1))
        return out if self._same_dims else out.index_select(1, self._columns)


class BaseUniqueEmbeddingSharding(BaseGridEmbeddingSharding[C]):
    """Embark's UB cluster: the grid's cells, with the de-duplicating input dist (module docstring). The
    generic base of the pooled and the sequence UB shardings, which differ in their lookups and output dists."""

    def unique_layout(self) -> UniqueLayout:
        """The static routing, built once from the cells (after the sharding is built)."""
        layout: Optional[UniqueLayout] = getattr(self, "_unique_layout", None)
        if layout is None:
            cells_on = [[self._cells[v] for v in names] for names in self.feature_names_per_rank()]
            layout = self._unique_layout = UniqueLayout.build(
                self._embedding_names,
                self._feature_dims,
                self._feature_rows,
                self._feature_bounds,
                cells_on,
                emb_dims_per_rank(self),
            )
        return layout

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        pg = self.dist_group()
        return UniqueSparseFeaturesDist(
            pg, self.unique_layout(), self._weighted, self._feature_mean, self.dist_device(device)
        )

    def lookup_input(
        self, received: KeyedJaggedTensor, lookup: torch.nn.Module, mode: str
    ) -> tuple[KeyedJaggedTensor, np.ndarray]:
        """What this rank's lookup takes, from what its input dist received (unique_lookup_input);
        `mode` as the sharder's unique_lookup."""
        pg = self.dist_group()
        rank = dist.get_rank(pg)
        variable_batch = getattr(self, "_variable_batch", None)
        if variable_batch is None:
            capable = supports_variable_batch(lookup)
            if mode == "variable_batch" and not capable:
                raise ValueError(
                    "unique_lookup='variable_batch' needs a TBE optimizer that takes variable batch sizes "
                    f"({sorted(o.name for o in VARIABLE_BATCH_OPTIMIZERS)}); use 'auto' or 'padded'"
                )
            on_gpu = received.values().device.type == "cuda"
            variable_batch = self._variable_batch = mode == "variable_batch" or (mode == "auto" and capable and on_gpu)
        return unique_lookup_input(
            received, self.unique_layout(), rank, self.feature_names_per_rank()[rank], variable_batch
        )


class UniquePooledEmbeddingSharding(BaseUniqueEmbeddingSharding[UniqueShardingContext]):
    """Embark's UB cluster for pooled tables: TorchRec's pooled lookup of the cells, bags pooled by the sender."""

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BaseEmbeddingLookup:
        return pooled_lookup(self, device, feature_processor)

    def create_output_dist(self, device: Optional[torch.device] = None) -> UniquePooledEmbeddingDist:  # type: ignore[override]
        pg = self.dist_group()
        return UniquePooledEmbeddingDist(
            pg, self.unique_layout(), self._feature_tables, self.dist_device(device), self.wire_codecs()
        )
