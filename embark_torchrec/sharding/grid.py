"""Grid sharding: any R x C grid of a table, uneven row bounds, any rank for each cell.

TorchRec's built-in types cannot express this (a table gets one sharding type, and RW/TWRW bucketize
with their own even blocks). Each cell runs as a table-wise "virtual feature" on its rank, so
torchrec's table-wise lookup, fused optimizers and all-to-alls do the work:

- input dist: every rank cuts each feature's IDs by the table's row bounds (fbgemm's block
  bucketizer with explicit bounds; local IDs = ID - first row of the slice) into one virtual
  feature per cell, then a KJT all-to-all sends each to its owner;
- lookup: torchrec's fused TBE over the cells a rank holds (SUM pooling);
- output dist: an all-to-all brings every cell's partial sums for a rank's samples home, where they
  are summed per (feature, column) into the pooled output; or, for hierarchical layouts, the sums
  are reduced inside each node first and cross nodes once (HierarchicalPooledEmbeddingDist).

BaseGridEmbeddingSharding holds the cells and what the module sees (its features and embedding names);
it is the generic base of the pooled GridPooledEmbeddingSharding here, of the sequence sharding
(sequence.py) and of the unique-based ones (unique.py), which are siblings as TorchRec's pooled and
sequence table-wise shardings are: each chooses its own lookup and dists.

MEAN pooling is exact without any state between input and output dist: each ID is weighted by
1 / (its bag's length) before it is cut, so the partial sums add up to the mean. Weighted features
keep their weights (multiplied by that factor for MEAN tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata
from torch.distributed._shard.sharding_spec import ShardMetadata
from torchrec.distributed.comm import get_local_size, intra_and_cross_node_pg
from torchrec.distributed.fbgemm_qcomm_codec import CommOp
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingSharding,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import (
    BaseEmbeddingLookup,
    BaseGroupedFeatureProcessor,
    EmbeddingComputeKernel,
    ShardedEmbeddingTable,
)
from torchrec.distributed.sharding.tw_sharding import BaseTwEmbeddingSharding
from torchrec.distributed.types import Awaitable, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..plan.layout.tables import Shard, grid_from_shards
from ..plan.model.topology import Topology
from ..plan.layout.wire import MAX_SLICE_ROWS
from .codecs import active_codec, intra_node_codecs
from .collectives import all_to_all
from .comm_stats import CountsComm, Ledger, group_ranks
from .torchrec_compat import (
    emb_dims_per_rank,
    has_rowwise_state,
    sharding_device,
    sharding_env,
    sharding_group,
    sharding_grouped_configs,
    sharding_world_size,
)
from .variable_batch import FeatureMajor, pad_to_uniform


@dataclass(frozen=True)
class CellRoute:
    """Where one virtual feature comes from: feature index, its cell's row slice and first column."""

    feature: int
    row_slice: int
    col_start: int


def virtual_feature(embedding_name: str, row_slice: int, col_slice: int) -> str:
    """A cell's key: its table's embedding name for the feature (unique even when tables share the feature)."""
    return f"{embedding_name}#{row_slice}.{col_slice}"


def bag_weights(kjt: KeyedJaggedTensor, mean: torch.Tensor) -> torch.Tensor:
    """Per-ID weights that make a SUM of the IDs' rows equal the bag's pooled value: the feature's
    weights (or 1), times 1 / (bag length) for MEAN features (`mean`: one flag per key)."""
    lengths = kjt.lengths().long()
    n_ids = kjt.values().numel()
    weights = kjt.weights_or_none()
    weights = weights if weights is not None else torch.ones(n_ids, device=lengths.device)
    scale = torch.where(mean.repeat_interleave(kjt.stride()), 1.0 / lengths.clamp(min=1), 1.0).to(weights.dtype)
    return weights * scale.repeat_interleave(lengths, output_size=n_ids)


class ColumnRun(NamedTuple):
    """One cell's partial sums in the output: its first output column, width and table."""

    start: int
    width: int
    table: str


class RunTable:
    """A rank's (or a node's) partial sums as column runs, in column order: their output columns
    (host-side layout, numpy; the dists keep on the device what they need), their widths as the row pattern our
    fp8 codec scales (one scale per cell per row, as the cost model prices it), and, for counting,
    their tables."""

    def __init__(self, runs: List[ColumnRun]) -> None:
        self.pattern = tuple(r.width for r in runs)
        self.dim = sum(self.pattern)
        self.targets = np.asarray([c for r in runs for c in range(r.start, r.start + r.width)], dtype=np.int64)
        self._tables = [r.table for r in runs]
        self._run_index = np.arange(len(runs))
        self._widths = np.asarray(self.pattern, dtype=np.float64)

    def add(self, ledger: Ledger, members: np.ndarray, received: bool, rows: np.ndarray) -> None:
        """Counts `rows[i]` rows of every run to or from ledger member `members[i]`."""
        n = len(self._tables)
        if not n:
            return
        per_run = np.repeat(rows.astype(np.float64), n)
        elems = per_run * np.tile(self._widths, len(members))
        ledger.add_many(
            self._tables, np.tile(self._run_index, len(members)), np.repeat(members, n), received, elems, per_run
        )


class ColumnFold:
    """Sums blocks of partial sums into an output of `width` columns: block i's column j adds into
    output column targets[i][j].

    Blocks with identical targets are first added elementwise; then, when no output column is hit
    twice, the output is assembled by splitting and concatenating when the source falls into a few
    runs of consecutive output columns (column-wise index ops are several times slower, forward and
    backward), or by one column gather when there are many runs (split and cat would cost an op per
    run, i.e. per table); otherwise by index_add.
    """

    MAX_RUNS = 8  # above this, one gather instead of an op per run

    def __init__(self, targets: List[np.ndarray], width: int, device: torch.device) -> None:
        self._width = width
        groups: Dict[tuple, List[int]] = {}
        for i, t in enumerate(targets):
            groups.setdefault(tuple(int(c) for c in t), []).append(i)
        self._groups = list(groups.values())
        combined = [c for key in groups for c in key]
        self._target = torch.tensor(combined, dtype=torch.int64, device=device)
        # one group whose columns are the output's, in order: the (summed) block is the output, no op to assemble it
        self._identity = len(self._groups) == 1 and combined == list(range(width))
        # Without overlaps: the source columns fall into runs that land on consecutive output
        # columns; split the source into those runs (one cat in backward) and concatenate them in
        # output order, with zero blocks for columns no block reaches.
        self._runs: Optional[List[int]] = None  # run widths, in source order
        self._layout: List[tuple[int, int]] = []  # (run index or -1 for zeros, width), in output order
        self._gather: Optional[torch.Tensor] = None  # per output column: its source column (len(combined): zero)
        if len(set(combined)) == len(combined):
            runs: List[List[int]] = []  # [first output column, width]
            for col in combined:
                if runs and runs[-1][0] + runs[-1][1] == col:
                    runs[-1][1] += 1
                else:
                    runs.append([col, 1])
            if len(runs) > self.MAX_RUNS:
                source = {col: i for i, col in enumerate(combined)}
                gather = [source.get(col, len(combined)) for col in range(width)]
                self._gather = torch.tensor(gather, dtype=torch.int64, device=device)
                self._gaps = len(combined) < width
                return
            self._runs = [w for _, w in runs]
            position = 0
            for index, (start, w) in sorted(enumerate(runs), key=lambda r: r[1][0]):
                if start > position:
                    self._layout.append((-1, start - position))
                self._layout.append((index, w))
                position = start + w
            if position < width:
                self._layout.append((-1, width - position))

    def __call__(self, blocks: List[torch.Tensor]) -> torch.Tensor:
        summed = [blocks[g[0]] if len(g) == 1 else torch.stack([blocks[i] for i in g]).sum(dim=0) for g in self._groups]
        src = summed[0] if len(summed) == 1 else torch.cat(summed, dim=1)
        if self._identity:
            return src
        if self._gather is not None:
            if self._gaps:
                src = torch.cat([src, src.new_zeros(src.size(0), 1)], dim=1)
            return src.index_select(1, self._gather)
        if self._runs is None:
            return src.new_zeros(src.size(0), self._width).index_add(1, self._target, src)
        pieces = torch.split(src, self._runs, dim=1)
        parts = [pieces[i] if i >= 0 else src.new_zeros(src.size(0), w) for i, w in self._layout]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class BlockGather:
    """Blocks lying one after another in a flat message (block i: rows x its width, row-major) placed into an output
    of `width` columns (block i's column j at output column targets[i][j]) by one gather, where every output column
    comes from exactly one block (`applies`): three ops forward where splitting, viewing and ColumnFold take two or
    more per block, and fewer backward. It gathers chunks, the widest run of columns that every block's width and
    every piece of consecutive columns (its start and length) is a multiple of: whole cell vectors rather than
    single columns (column-wise index ops are slow). The index depends on the rows: built once per batch size."""

    def __init__(self, targets: List[np.ndarray], width: int, device: torch.device) -> None:
        combined = np.concatenate(targets) if targets else np.zeros(0, dtype=np.int64)
        self.applies = width > 0 and np.array_equal(np.sort(combined), np.arange(width))
        self._width, self._device = width, device
        self._indices: Dict[int, torch.Tensor] = {}
        if not self.applies:
            return
        self._widths = np.array([len(t) for t in targets], dtype=np.int64)
        order = np.argsort(combined)  # per output column: its place among the blocks' columns
        self._block = np.repeat(np.arange(len(targets)), self._widths)[order]
        self._column = np.concatenate([np.arange(len(t)) for t in targets])[order]
        starts = np.flatnonzero(
            np.r_[True, (self._block[1:] != self._block[:-1]) | (self._column[1:] != self._column[:-1] + 1)]
        )
        self._chunk = int(np.gcd.reduce(np.concatenate([[width], self._widths, starts, self._column[starts]])))

    def __call__(self, flat: torch.Tensor, rows: int) -> torch.Tensor:
        index = self._indices.get(rows)
        if index is None:
            first = np.arange(0, self._width, self._chunk)  # each chunk's first output column
            block = self._block[first]
            offsets = (np.cumsum(self._widths) - self._widths) * rows
            element = offsets[block] + np.arange(rows)[:, None] * self._widths[block] + self._column[first]
            index = self._indices[rows] = torch.as_tensor(element.reshape(-1) // self._chunk, device=self._device)
        return flat.view(-1, self._chunk).index_select(0, index).view(rows, self._width)


class GridSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Cuts each feature's IDs into per-cell virtual features, then a KJT all-to-all."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        table_rows: List[int],
        mean: List[bool],
        row_bounds: List[List[int]],
        routes: List[CellRoute],
        virtual_names: List[str],
        features_per_rank: List[int],
        weighted: bool,
        device: torch.device,
    ) -> None:
        super().__init__()
        from torchrec.distributed.dist_data import KJTAllToAll

        self._weighted = weighted or any(mean)
        self._virtual_names = virtual_names
        # fbgemm cuts every feature into the same number of buckets (a feature with fewer row
        # slices gets empty trailing ones), bucket-major; a route is one (bucket, feature) row.
        n_features = self._n_features = len(row_bounds)
        buckets = max(len(bounds) - 1 for bounds in row_bounds)
        self._buckets = buckets
        # one row of bucket bounds per feature (fbgemm takes them as a list of tensors)
        self._bucket_pos = list(
            torch.tensor(
                [list(b) + [b[-1]] * (buckets + 1 - len(b)) for b in row_bounds], dtype=torch.int64, device=device
            ).unbind(0)
        )
        self._block_sizes = torch.tensor([max(1, -(-rows // buckets)) for rows in table_rows], device=device)
        self._mean = torch.tensor(mean, device=device)
        self._route_rows = torch.tensor(
            [r.row_slice * n_features + r.feature for r in routes], dtype=torch.int32, device=device
        )
        self._dist = KJTAllToAll(pg=pg, splits=features_per_rank)

    def _cut(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        stride = kjt.stride()
        lengths = kjt.lengths().long()
        ids = kjt.values().long()
        weights = bag_weights(kjt, self._mean) if self._weighted else None
        if self._buckets == 1:  # no table is row-split: every ID is already its cell's local row
            bucket_lengths, local, bucket_weights = lengths, ids, weights
        else:
            bucket_lengths, local, bucket_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
                lengths, ids, False, False, self._block_sizes, self._buckets, weights, None, -1, self._bucket_pos
            )
        out_lengths, out_values, out_weights = torch.ops.fbgemm.permute_2D_sparse_data(
            self._route_rows, bucket_lengths.view(self._buckets * self._n_features, stride), local, bucket_weights, None
        )
        return KeyedJaggedTensor(
            keys=self._virtual_names,
            values=out_values.to(torch.int32),  # row-local IDs (GridPooledEmbeddingSharding refuses >= 2^31 rows)
            lengths=out_lengths.reshape(-1).to(torch.int32),
            weights=out_weights if self._weighted else None,
            stride=stride,
        )

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return self._dist(self._cut(pad_to_uniform(sparse_features)))


def batch_per_rank(
    local_embs: torch.Tensor, sharding_ctx: Optional[EmbeddingShardingContext], world_size: int
) -> List[int]:
    """Each rank's batch size: from the input dist's context, or equal parts of the lookup output."""
    if sharding_ctx is not None and sharding_ctx.batch_size_per_rank:
        return list(sharding_ctx.batch_size_per_rank)
    return [local_embs.size(0) // world_size] * world_size


OnSend = Callable[[torch.Tensor, List[int], List[int], bool], None]


def _ledger_hook(ledger: Optional[Ledger], codecs: Optional[QuantizedCommCodecs]) -> Optional[OnSend]:
    """An all_to_all on_send hook that records a ledger's bytes when each direction is sent."""
    if ledger is None:
        return None

    def on_send(payload: torch.Tensor, send_sizes: List[int], recv_sizes: List[int], backward: bool) -> None:
        codec = active_codec(codecs.backward if backward else codecs.forward) if codecs else None
        ledger.record(codec, backward, payload.element_size(), send_sizes, recv_sizes)

    return on_send


class GridPooledEmbeddingDist(BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor], CountsComm):
    """All-to-all of every cell's partial sums (started here, waited where TorchRec waits the
    module's output), then a sum per (feature, column) at home."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        runs_per_rank: List[List[ColumnRun]],
        feature_dims: List[int],
        device: torch.device,
        codecs: Optional[QuantizedCommCodecs] = None,
    ) -> None:
        super().__init__()
        self._pg, self._codecs = pg, codecs
        self._world_size, self._rank = dist.get_world_size(pg), dist.get_rank(pg)
        self._out_dim = out_dim = sum(feature_dims)
        self._feature_major = FeatureMajor(feature_dims, device)
        self._runs = [RunTable(runs) for runs in runs_per_rank]
        self._dims = [r.dim for r in self._runs]
        self._fold = ColumnFold([np.concatenate([r.targets for r in self._runs])], out_dim, device)

    def _ledger(self, batch: List[int]) -> Optional[Ledger]:
        if self.comm_stats is None:
            return None
        members = np.arange(self._world_size)
        ledger = Ledger(self.comm_stats, self.comm_sharding_type, list(range(self._world_size)))
        self._runs[self._rank].add(ledger, members, False, np.asarray(batch))
        for k in range(self._world_size):
            self._runs[k].add(ledger, np.array([k]), True, np.array([batch[self._rank]]))
        return ledger

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: Optional[EmbeddingShardingContext] = None
    ) -> Awaitable[torch.Tensor]:
        batch = batch_per_rank(local_embs, sharding_ctx, self._world_size)
        here, mine = batch[self._rank], self._runs[self._rank]
        dim = mine.dim
        send = [[(b * dim, mine.pattern)] for b in batch]
        recv = [[(here * r.dim, r.pattern)] for r in self._runs]
        awaitable = all_to_all(
            local_embs.reshape(-1),
            send,
            recv,
            self._pg,
            self._codecs,
            self._world_size,
            _ledger_hook(self._ledger(batch), self._codecs),
        )
        dims = self._dims

        def fold(received: torch.Tensor) -> torch.Tensor:
            blocks = [b.view(here, d) for b, d in zip(torch.split(received, [here * d for d in dims]), dims) if d]
            return self._fold([torch.cat(blocks, dim=1)]) if blocks else received.new_zeros(here, self._out_dim)

        awaitable.callbacks.append(fold)
        if sharding_ctx is not None and sharding_ctx.variable_batch_per_feature:
            awaitable.callbacks.append(self._feature_major)
        return awaitable


class HierarchicalPooledEmbeddingDist(
    BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor], CountsComm
):
    """Partial sums reduced inside each node first, then once across nodes (EMBark's hierarchical RB).

    Stage 1, intra-node all-to-all: for destination j, every rank sends its partial sums to the rank
    of its node whose local rank is j's, which sums them per (feature, column). Stage 2, cross-node
    all-to-all among ranks of equal local rank: each such aggregator sends j its node's sums, for
    the columns its node holds only; j adds the nodes' sums up. Stage 1 runs at the precision
    wire.intra_node_reduction_precision gives (fp32 partial sums for an fp8 layout: codecs.intra_node_codecs),
    stage 2 at the layout's. Stage 1 is waited at once (as
    TorchRec's table-row-wise waits its intra-node reduce-scatter); stage 2 where the module's
    output is waited.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        local_world_size: int,
        runs_per_rank: List[List[ColumnRun]],
        feature_dims: List[int],
        device: torch.device,
        codecs: Optional[QuantizedCommCodecs] = None,
    ) -> None:
        super().__init__()
        self._codecs, self._intra_codecs, self._device = codecs, intra_node_codecs(codecs), device
        out_dim = sum(feature_dims)
        self._feature_major = FeatureMajor(feature_dims, device)
        self._world_size = dist.get_world_size(pg)
        self._rank = dist.get_rank(pg)
        self._lws = local_world_size
        self._nodes = self._world_size // local_world_size
        self._intra, self._cross = intra_and_cross_node_pg(backend=dist.get_backend(pg))
        self._runs = [RunTable(runs) for runs in runs_per_rank]
        self._dims = [r.dim for r in self._runs]
        # Each node sends across only the column slices its ranks hold (each once); each member's
        # partial-sum columns fold into them as positions in the node's columns.
        self._node_runs: List[RunTable] = []
        self._node_folds: List[ColumnFold] = []  # the members' partial sums into their node's columns
        # per node: (members holding columns, their width) when all of them hold the same columns in the same order
        # (their blocks, side by side in stage 1's message, are summed as one view), else (0, 0)
        self._alike: List[Tuple[int, int]] = []
        for n in range(self._nodes):
            members = [r for r in self._runs[n * local_world_size : (n + 1) * local_world_size] if r.dim]
            node = RunTable(
                sorted(
                    {run for runs in runs_per_rank[n * local_world_size : (n + 1) * local_world_size] for run in runs}
                )
            )
            self._node_runs.append(node)
            alike = bool(members) and all(np.array_equal(r.targets, members[0].targets) for r in members)
            self._alike.append((len(members), members[0].dim) if alike else (0, 0))
            targets = [np.searchsorted(node.targets, r.targets) for r in (members[:1] if alike else members)]
            self._node_folds.append(ColumnFold(targets, node.dim, device))
        self._node_widths = [r.dim for r in self._node_runs]
        cross_targets = [r.targets for r in self._node_runs if r.dim]  # the nodes' sums at home
        self._cross_fold = ColumnFold(cross_targets, out_dim, device)
        self._cross_gather = BlockGather(cross_targets, out_dim, device)  # where nodes hold distinct columns
        self._intra_peers, self._cross_peers = group_ranks(self._intra), group_ranks(self._cross)
        self._orders: Dict[Tuple[int, ...], torch.Tensor] = {}  # per batch sizes: stage 1's row order
        # the routing (Topology.aggregator): the destinations each member of my node sums for, node-major
        topology, node = Topology(self._world_size, local_world_size), self._rank // local_world_size
        self._routed = [
            [d for d in range(self._world_size) if topology.aggregator(node, d) == node * local_world_size + m]
            for m in range(local_world_size)
        ]

    def _ledgers(self, batch_per_rank: List[int]) -> tuple[Optional[Ledger], Optional[Ledger]]:
        """What stage 1 and stage 2 exchange, per table and peer (None when not counting)."""
        if self.comm_stats is None:
            return None, None
        lws = self._lws
        node, local = divmod(self._rank, lws)
        mine = sum(batch_per_rank[d] for d in self._routed[local])
        intra = Ledger(self.comm_stats, self.comm_sharding_type, self._intra_peers)
        sent = np.array([sum(batch_per_rank[d] for d in routed) for routed in self._routed])
        self._runs[self._rank].add(intra, np.arange(lws), False, sent)
        for m in range(lws):
            self._runs[node * lws + m].add(intra, np.array([m]), True, np.array([mine]))
        cross = Ledger(self.comm_stats, self.comm_sharding_type, self._cross_peers)
        sent = np.array([batch_per_rank[d] for d in self._routed[local]])
        self._node_runs[node].add(cross, np.arange(self._nodes), False, sent)
        for n in range(self._nodes):
            self._node_runs[n].add(cross, np.array([n]), True, np.array([batch_per_rank[self._rank]]))
        return intra, cross

    def _order(self, batch_per_rank: List[int]) -> torch.Tensor:
        """Stage 1's send order: to each node member, the rows of the destinations it sums for, in
        one gather, so that backward is one scatter; built once per batch sizes."""
        key = tuple(batch_per_rank)
        order = self._orders.get(key)
        if order is None:
            starts = [0]
            for b in batch_per_rank:
                starts.append(starts[-1] + b)
            rows = [r for routed in self._routed for d in routed for r in range(starts[d], starts[d + 1])]
            order = self._orders[key] = torch.tensor(rows, dtype=torch.int64, device=self._device)
        return order

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: Optional[EmbeddingShardingContext] = None
    ) -> Awaitable[torch.Tensor]:
        batch = batch_per_rank(local_embs, sharding_ctx, self._world_size)
        lws = self._lws
        node, local = divmod(self._rank, lws)
        dim, pattern = self._dims[self._rank], self._runs[self._rank].pattern
        send_sizes = [sum(batch[d] for d in routed) * dim for routed in self._routed]
        mine = [batch[d] for d in self._routed[local]]  # the destinations I sum for, one per node
        members = self._runs[node * lws : (node + 1) * lws]
        member_dims = [r.dim for r in members]
        recv_sizes = [sum(mine) * d for d in member_dims]
        intra_ledger, cross_ledger = self._ledgers(batch)
        # stage 1; gradients are divided by the world size here, once for both stages
        received = all_to_all(
            local_embs.index_select(0, self._order(batch)).reshape(-1),
            [[(size, pattern)] for size in send_sizes],
            [[(size, r.pattern)] for size, r in zip(recv_sizes, members)],
            self._intra,
            self._intra_codecs,
            self._world_size,
            _ledger_hook(intra_ledger, self._intra_codecs),
        ).wait()
        width, node_pattern = self._node_widths[node], self._node_runs[node].pattern
        (alike, alike_dim), rows = self._alike[node], sum(mine)
        if alike:  # the members' blocks as one [members, rows, columns] view: one sum, no split
            block = received.view(alike, rows, alike_dim)
            blocks = [block.sum(dim=0) if alike > 1 else block[0]]
        else:
            blocks = [block.view(rows, d) for block, d in zip(torch.split(received, recv_sizes), member_dims) if d]
        node_sum = self._node_folds[node](blocks) if blocks else local_embs.new_zeros(rows, 0)
        # stage 2: to node n's rank with my local rank, my node's sums (its columns only) for its samples
        here = batch[self._rank]
        widths = self._node_widths
        awaitable = all_to_all(
            node_sum.reshape(-1),
            [[(b * width, node_pattern)] for b in mine],
            [[(here * r.dim, r.pattern)] for r in self._node_runs],
            self._cross,
            self._codecs,
            1,
            _ledger_hook(cross_ledger, self._codecs),
        )

        def fold(gathered: torch.Tensor) -> torch.Tensor:
            if self._cross_gather.applies:
                return self._cross_gather(gathered, here)
            parts = [b.view(here, w) for b, w in zip(torch.split(gathered, [here * w for w in widths]), widths) if w]
            return self._cross_fold(parts)

        awaitable.callbacks.append(fold)
        if sharding_ctx is not None and sharding_ctx.variable_batch_per_feature:
            awaitable.callbacks.append(self._feature_major)
        return awaitable


C = TypeVar("C", bound=EmbeddingShardingContext)


def pooled_lookup(
    sharding: EmbeddingSharding,
    device: Optional[torch.device],
    feature_processor: Optional[BaseGroupedFeatureProcessor],
) -> BaseEmbeddingLookup:
    """TorchRec's pooled table-wise lookup over a sharding's cells (as TwPooledEmbeddingSharding builds it)."""
    return GroupedPooledEmbeddingsLookup(
        grouped_configs=sharding_grouped_configs(sharding),
        pg=sharding_group(sharding),
        device=device if device is not None else sharding_device(sharding),
        feature_processor=feature_processor,
        env=sharding_env(sharding),
    )


class BaseGridEmbeddingSharding(BaseTwEmbeddingSharding[C, KeyedJaggedTensor, torch.Tensor, torch.Tensor]):
    """The cells of any grid of the planner's as table-wise virtual features, and the original features and
    embedding names the module sees. The generic base of the pooled and the sequence shardings of our grid and
    unique-based clusters (as TorchRec's BaseTwEmbeddingSharding is of its table-wise ones): they differ in
    their dists and lookups, and none of them is a subclass of another."""

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        self._features: List[str] = []
        self._embedding_names: List[str] = []  # TorchRec's: "feature@table" for a feature read by several tables
        self._feature_tables: List[str] = []
        self._feature_rows: List[int] = []
        self._feature_dims: List[int] = []
        self._feature_mean: List[bool] = []
        self._feature_bounds: List[List[int]] = []
        self._cells: Dict[str, CellRoute] = {}
        self._weighted = any(info.embedding_config.is_weighted for info in sharding_infos)
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)

    def _shard(self, sharding_infos: List[EmbeddingShardingInfo]) -> List[List[ShardedEmbeddingTable]]:
        tables_per_rank: List[List[ShardedEmbeddingTable]] = [[] for _ in range(sharding_world_size(self))]
        for info in sharding_infos:
            cfg = info.embedding_config
            shards: List[ShardMetadata] = info.param_sharding.sharding_spec.shards  # type: ignore[union-attr]
            row_bounds, col_bounds, _ = grid_from_shards(
                f"table {cfg.name!r}",
                [
                    Shard(
                        (s.shard_offsets[0], s.shard_offsets[0] + s.shard_sizes[0]),
                        (s.shard_offsets[1], s.shard_offsets[1] + s.shard_sizes[1]),
                        s.placement.rank(),  # type: ignore[union-attr]
                    )
                    for s in shards
                ],
            )
            rows, cols = list(row_bounds), list(col_bounds)
            optimizer = (info.fused_params or {}).get("optimizer")
            if len(rows) > 2 and len(cols) > 2 and has_rowwise_state(optimizer):
                raise ValueError(
                    f"table {cfg.name!r}: a {len(rows) - 1} x {len(cols) - 1} grid cannot keep {optimizer}'s "
                    "per-row state (TorchRec's fused optimizer lays it out for row-only or column-only cuts); "
                    "cut its rows or its columns, not both (EmbarkPlanner does so for such optimizers)"
                )
            longest = max(b - a for a, b in zip(rows, rows[1:]))
            if longest >= MAX_SLICE_ROWS:
                raise ValueError(
                    f"table {cfg.name!r}: a row slice of {longest} rows is too long for the int32 row-local IDs our "
                    f"sharding sends; split its rows into slices of fewer than {MAX_SLICE_ROWS}"
                )
            first = len(self._features)
            embedding_names = list(cfg.embedding_names) or list(cfg.feature_names)
            for name, embedding_name in zip(cfg.feature_names, embedding_names):
                self._features.append(name)
                self._embedding_names.append(embedding_name)
                self._feature_tables.append(cfg.name)
                self._feature_rows.append(cfg.num_embeddings)
                self._feature_dims.append(cfg.embedding_dim)
                self._feature_mean.append(cfg.pooling == PoolingType.MEAN)
                self._feature_bounds.append(rows)
            global_metadata = ShardedTensorMetadata(
                shards_metadata=shards, size=torch.Size([cfg.num_embeddings, cfg.embedding_dim])
            )
            for shard in shards:
                r, c = rows.index(shard.shard_offsets[0]), cols.index(shard.shard_offsets[1])
                names = [virtual_feature(e, r, c) for e in embedding_names]
                for i, v in enumerate(names):
                    self._cells[v] = CellRoute(first + i, r, shard.shard_offsets[1])
                tables_per_rank[shard.placement.rank()].append(  # type: ignore[union-attr]
                    ShardedEmbeddingTable(
                        num_embeddings=cfg.num_embeddings,
                        embedding_dim=cfg.embedding_dim,
                        name=cfg.name,
                        embedding_names=names,
                        data_type=cfg.data_type,
                        feature_names=names,
                        pooling=PoolingType.SUM,
                        is_weighted=cfg.is_weighted,
                        has_feature_processor=cfg.has_feature_processor,
                        local_rows=shard.shard_sizes[0],
                        local_cols=shard.shard_sizes[1],
                        compute_kernel=EmbeddingComputeKernel(info.param_sharding.compute_kernel),
                        local_metadata=shard,
                        global_metadata=global_metadata,
                        fused_params=info.fused_params,
                        weight_init_max=cfg.weight_init_max,
                        weight_init_min=cfg.weight_init_min,
                    )
                )
        return tables_per_rank

    # The module sees the original features (a shared one once per table) and TorchRec's embedding
    # names; the cells are internal.
    def feature_names(self) -> List[str]:
        return list(self._features)

    def embedding_names(self) -> List[str]:
        return list(self._embedding_names)

    def embedding_dims(self) -> List[int]:
        return list(self._feature_dims)

    def embedding_shard_metadata(self) -> List[Optional[ShardMetadata]]:
        return [None] * len(self._features)

    def uncombined_embedding_names(self) -> List[str]:
        return self.embedding_names()

    def uncombined_embedding_dims(self) -> List[int]:
        return self.embedding_dims()

    def dist_group(self) -> dist.ProcessGroup:
        """The process group our dists run on (TorchRec's sharding keeps it optional; ours always have one)."""
        pg = sharding_group(self)
        assert pg is not None
        return pg

    def dist_device(self, device: Optional[torch.device]) -> torch.device:
        """Where a dist's tensors go: the device given, else the sharding's (TorchRec builds input
        dists without one), else the CPU."""
        chosen = device if device is not None else sharding_device(self)
        return chosen if chosen is not None else torch.device("cpu")

    def wire_codecs(self) -> Optional[QuantizedCommCodecs]:
        """The codecs of the cluster's wire precision for the embeddings' all-to-all (TorchRec's registry key)."""
        return (self.qcomm_codecs_registry or {}).get(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name)


class GridPooledEmbeddingSharding(BaseGridEmbeddingSharding[EmbeddingShardingContext]):
    """Embark's RB cluster for pooled tables: every layout of the planner, run exactly (module docstring); with
    `hierarchical`, the partial sums are reduced inside each node before they cross nodes."""

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        hierarchical: bool = False,
    ) -> None:
        self._hierarchical = hierarchical
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)

    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BaseEmbeddingLookup:
        return pooled_lookup(self, device, feature_processor)

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        pg = self.dist_group()
        virtual = [v for names in self.feature_names_per_rank() for v in names]
        return GridSparseFeaturesDist(
            pg,
            self._feature_rows,
            self._feature_mean,
            self._feature_bounds,
            [self._cells[v] for v in virtual],
            virtual,
            self.features_per_rank(),
            self._weighted,
            self.dist_device(device),
        )

    def create_output_dist(
        self, device: Optional[torch.device] = None
    ) -> BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]:
        pg = self.dist_group()
        offsets = [0]
        for d in self._feature_dims:
            offsets.append(offsets[-1] + d)
        device = self.dist_device(device)
        runs_per_rank = [  # each rank's cells, in its partial sums' column order
            [self._column_run(self._cells[v], int(width), offsets) for v, width in zip(names, dims)]
            for names, dims in zip(self.embedding_names_per_rank(), emb_dims_per_rank(self))
        ]
        codecs = self.wire_codecs()
        if self._hierarchical:
            local_world_size = get_local_size(sharding_world_size(self))
            return HierarchicalPooledEmbeddingDist(
                pg, local_world_size, runs_per_rank, self._feature_dims, device, codecs
            )
        return GridPooledEmbeddingDist(pg, runs_per_rank, self._feature_dims, device, codecs)

    def _column_run(self, cell: CellRoute, width: int, offsets: List[int]) -> ColumnRun:
        """Where a cell's partial sums land in the module's output (`offsets`: each feature's first column)."""
        return ColumnRun(offsets[cell.feature] + cell.col_start, width, self._feature_tables[cell.feature])
