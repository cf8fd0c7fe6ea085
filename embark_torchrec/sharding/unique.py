"""Unique-based (UB) cluster: each distinct ID travels once, and one vector per distinct ID comes back.

The table's cells are table-wise virtual features as in grid.py, so torchrec's fused lookup and
optimizers hold the weights; only the dists differ:

- input dist (UniqueSparseFeaturesDist): a rank de-duplicates its IDs per (feature, row slice),
  a "group", with one torch.unique over all its features; it sends each group's distinct row-local
  IDs once to every rank holding cells of that row slice (the counts first, as int32), and the
  owner looks each received ID up as a bag of one: a KJT whose stride is the largest group it
  received (shorter cells get empty bags);
- output dist (UniquePooledEmbeddingDist): the owner sends every sender the rows of its distinct
  IDs, cell by cell; the sender assembles each feature's distinct vectors from its cells and
  expands them into its bags with embedding_bag (sum, with per-ID weights: the feature's weights
  times 1 / bag length for MEAN). Backward, embedding_bag sums the gradients per distinct ID, and
  the all-to-all carries one gradient row per distinct ID back to its owner.

What the output dist needs from its batch's input dist (the inverse map, the counts) travels in
that batch's sharding context (UniqueShardingContext), so pipelined batches never mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist, EmbeddingShardingContext
from torchrec.distributed.fbgemm_qcomm_codec import CommOp
from torchrec.distributed.types import Awaitable, NoWait, QuantizedCommCodecs
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..plan.groups import EMBARK_ID_BYTES
from .comm_stats import CountsComm, Ledger
from .grid import CellRoute, GridPooledEmbeddingSharding, _DivideGradient, all_to_all, bag_weights

COUNT_BYTES = 4


def id_features(lengths: torch.Tensor, stride: int) -> torch.Tensor:
    """The feature index of each ID of a KJT (key-major, `stride` bags per key)."""
    per_key = lengths.view(-1, stride).sum(dim=1)
    return torch.repeat_interleave(torch.arange(per_key.numel(), device=lengths.device), per_key)


@dataclass
class UniqueState:
    """One batch's de-duplication, as its input dist leaves it: the sender's side and, from the
    counts exchanged first, how many IDs each sender sent this rank per group."""

    stride: int
    inverse: torch.Tensor  # per ID of the batch: its index among the distinct (feature, ID) keys
    group_counts: List[int]  # distinct IDs per group, on this rank
    lengths: torch.Tensor  # the batch's bag lengths, [features x stride]
    weights: Optional[torch.Tensor]  # per-ID weights for the expansion (None: all 1)
    received: List[List[int]]  # [sender][group held here]: IDs received


@dataclass
class UniqueShardingContext(EmbeddingShardingContext):
    unique: Optional[UniqueState] = field(default=None)


@dataclass(frozen=True)
class UniqueLayout:
    """The static routing of one UB sharding: groups, who holds them, and each rank's cells.

    Group g = (feature f, row slice r), numbered feature-major; its keys are the IDs of f in r
    offset by key_start[g], so one sorted torch.unique over all features orders IDs by group.
    """

    features: List[str]
    tables: List[str]
    dims: List[int]
    rows: List[int]
    mean: List[bool]
    group_feature: List[int]
    key_start: List[int]  # first key of each group (+ one past the last)
    groups_on: List[List[int]]  # per rank: the groups it holds cells of, ascending
    cells_on: List[List[CellRoute]]  # per rank: its cells, in lookup order
    cell_widths_on: List[List[int]]
    cell_group_on: List[List[int]]  # per rank, per cell: its group
    assembly: List[List[List[tuple[int, int]]]]  # [feature][row slice] -> (rank, cell index) per column slice, in column order

    @classmethod
    def build(
        cls,
        features: List[str],
        tables: List[str],
        dims: List[int],
        rows: List[int],
        mean: List[bool],
        row_bounds: List[List[int]],
        cells_on: List[List[CellRoute]],
        cell_widths_on: List[List[int]],
    ) -> "UniqueLayout":
        group_feature, key_start, first_group = [], [], []
        offset = 0
        for f, bounds in enumerate(row_bounds):
            first_group.append(len(group_feature))
            for start in bounds[:-1]:
                group_feature.append(f)
                key_start.append(offset + start)
            offset += rows[f]
        key_start.append(offset)
        cell_group_on = [[first_group[c.feature] + c.row_slice for c in cells] for cells in cells_on]
        assembly: List[List[List[tuple[int, int, int]]]] = [[[] for _ in b[:-1]] for b in row_bounds]
        for k, cells in enumerate(cells_on):
            for i, c in enumerate(cells):
                assembly[c.feature][c.row_slice].append((c.col_start, k, i))
        return cls(
            features=features,
            tables=tables,
            dims=dims,
            rows=rows,
            mean=mean,
            group_feature=group_feature,
            key_start=key_start,
            groups_on=[sorted(set(g)) for g in cell_group_on],
            cells_on=cells_on,
            cell_widths_on=cell_widths_on,
            cell_group_on=cell_group_on,
            assembly=[[[(k, i) for _, k, i in sorted(cols)] for cols in per_row] for per_row in assembly],
        )


class _ReceivedIds(Awaitable[KeyedJaggedTensor]):
    """The owner's lookup input, once the distinct IDs have arrived."""

    def __init__(self, dist_input: "UniqueSparseFeaturesDist", work: object, buffer: torch.Tensor, state: UniqueState) -> None:
        super().__init__()
        self._dist_input, self._work, self._buffer, self._state = dist_input, work, buffer, state

    def _wait_impl(self) -> KeyedJaggedTensor:
        if self._work is not None:
            self._work.wait()  # type: ignore[attr-defined]
        return self._dist_input.lookup_input(self._buffer, self._state)


class UniqueSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor], CountsComm):
    """De-duplicates per (feature, row slice) and sends each distinct ID once per owner."""

    def __init__(self, pg: dist.ProcessGroup, layout: UniqueLayout, cell_names: List[str], weighted: bool) -> None:
        super().__init__()
        self._pg, self._layout = pg, layout
        self._rank, self._world = dist.get_rank(pg), dist.get_world_size(pg)
        self._weighted = weighted or any(layout.mean)
        self._cell_names = cell_names
        self.register_buffer("_mean", torch.tensor(layout.mean), persistent=False)
        self.register_buffer("_key_start", torch.tensor(layout.key_start, dtype=torch.int64), persistent=False)
        self.register_buffer("_feature_key_start", torch.tensor(
            [layout.key_start[layout.group_feature.index(f)] for f in range(len(layout.features))], dtype=torch.int64
        ), persistent=False)
        self.last_state: Optional[UniqueState] = None

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        kjt = sparse_features
        stride = kjt.stride()
        lengths = kjt.lengths()
        ids = kjt.values().long()
        feature = id_features(lengths.long(), stride)
        keys, inverse = torch.unique(ids + self._feature_key_start[feature], sorted=True, return_inverse=True)
        group = torch.bucketize(keys, self._key_start, right=True) - 1
        counts = torch.bincount(group, minlength=len(self._layout.group_feature)).tolist()
        local_ids = keys - self._key_start[group]
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        groups_on = self._layout.groups_on
        send_counts = torch.tensor([counts[g] for k in range(self._world) for g in groups_on[k]], dtype=torch.int32)
        recv_counts = torch.empty(self._world * len(groups_on[self._rank]), dtype=torch.int32)
        dist.all_to_all_single(
            recv_counts, send_counts, [len(groups_on[self._rank])] * self._world, [len(g) for g in groups_on], group=self._pg
        )
        received = recv_counts.view(self._world, -1).tolist()
        pieces = [local_ids[starts[g] : starts[g + 1]] for k in range(self._world) for g in groups_on[k]]
        send = (torch.cat(pieces) if pieces else local_ids[:0]).to(torch.int32)
        in_sizes = [sum(counts[g] for g in groups_on[k]) for k in range(self._world)]
        out_sizes = [sum(r) for r in received]
        buffer = send.new_empty(sum(out_sizes))
        work = dist.all_to_all_single(buffer, send, out_sizes, in_sizes, group=self._pg, async_op=True)
        weights = bag_weights(kjt, self._mean) if self._weighted else None
        state = UniqueState(stride, inverse, counts, lengths, weights, received)
        if self.comm_stats is not None:
            self._count(counts, received)
        self.last_state = state
        return NoWait(_ReceivedIds(self, work, buffer, state))

    def take_state(self) -> UniqueState:
        """The state of the batch the last forward call cut; the sharded EBC files it in that
        batch's context."""
        state, self.last_state = self.last_state, None
        if state is None:
            raise RuntimeError("UniqueSparseFeaturesDist: no batch state to take; was forward called?")
        return state

    def lookup_input(self, buffer: torch.Tensor, state: UniqueState) -> KeyedJaggedTensor:
        """One bag of one ID per distinct ID received, per cell; cells of the same group share IDs."""
        layout, me = self._layout, self._rank
        mine = layout.groups_on[me]
        received = state.received
        sender_start = np.concatenate([[0], np.cumsum([sum(r) for r in received])]).tolist()
        per_group: Dict[int, List[torch.Tensor]] = {g: [] for g in mine}
        for s, counts in enumerate(received):
            offset = sender_start[s]
            for g, n in zip(mine, counts):
                per_group[g].append(buffer[offset : offset + n])
                offset += n
        group_ids = {g: torch.cat(parts) if parts else buffer[:0] for g, parts in per_group.items()}
        cell_groups = layout.cell_group_on[me]
        sizes = [len(group_ids[g]) for g in cell_groups]
        stride = max([1] + sizes)
        values = torch.cat([group_ids[g] for g in cell_groups]) if cell_groups else buffer[:0]
        positions = torch.arange(stride, device=buffer.device)
        lengths = (positions[None, :] < torch.tensor(sizes, device=buffer.device)[:, None]).to(torch.int32)
        return KeyedJaggedTensor(keys=self._cell_names, values=values, lengths=lengths.reshape(-1), stride=stride)

    def _count(self, counts: List[int], received: List[List[int]]) -> None:
        """IDs and counts each way, per table (the owner's received counts are known here)."""
        assert self.comm_stats is not None
        layout, world = self._layout, self._world
        tables = sorted(set(layout.tables))
        per: Dict[str, np.ndarray] = {t: np.zeros((4, world)) for t in tables}  # ids sent/recv, counts sent/recv
        for k in range(world):
            for g in layout.groups_on[k]:
                t = per[layout.tables[layout.group_feature[g]]]
                t[0, k] += counts[g] * EMBARK_ID_BYTES
                t[2, k] += COUNT_BYTES
        for s, row in enumerate(received):
            for g, n in zip(layout.groups_on[self._rank], row):
                t = per[layout.tables[layout.group_feature[g]]]
                t[1, s] += n * EMBARK_ID_BYTES
                t[3, s] += COUNT_BYTES
        for table, arr in per.items():
            if arr.any():
                self.comm_stats.record(self.comm_cluster, table, "ids", arr[0], arr[1])
                self.comm_stats.record(self.comm_cluster, table, "lengths", arr[2], arr[3])


class UniquePooledEmbeddingDist(BaseEmbeddingDist[UniqueShardingContext, torch.Tensor, torch.Tensor], CountsComm):
    """Sends each sender the rows of its distinct IDs; the sender expands them into its bags."""

    def __init__(self, pg: dist.ProcessGroup, layout: UniqueLayout, codecs: Optional[QuantizedCommCodecs] = None) -> None:
        super().__init__()
        self._pg, self._layout, self._codecs = pg, layout, codecs
        self._rank, self._world = dist.get_rank(pg), dist.get_world_size(pg)
        widths = layout.cell_widths_on[self._rank]
        self._col_starts = np.concatenate([[0], np.cumsum(widths)]).astype(int).tolist()

    def forward(self, local_embs: torch.Tensor, sharding_ctx: Optional[UniqueShardingContext] = None) -> Awaitable[torch.Tensor]:
        if sharding_ctx is None or sharding_ctx.unique is None:
            raise RuntimeError("UniquePooledEmbeddingDist needs its batch's UniqueShardingContext (set by the sharded EBC's input_dist)")
        state = sharding_ctx.unique
        layout, me, world = self._layout, self._rank, self._world
        received = state.received
        mine = layout.groups_on[me]
        position = {g: i for i, g in enumerate(mine)}
        # owner: for each sender, the rows of its distinct IDs in each of my cells
        offset_in_group = np.zeros((world, len(mine)), dtype=np.int64)
        if world > 1 and mine:
            offset_in_group[1:] = np.cumsum(np.asarray(received[:-1]), axis=0)
        x = _DivideGradient.apply(local_embs, world)
        widths, groups = layout.cell_widths_on[me], layout.cell_group_on[me]
        pieces, send = [], []
        for s in range(world):
            segments = []
            for i, (w, g) in enumerate(zip(widths, groups)):
                p = position[g]
                start, n = int(offset_in_group[s, p]), received[s][p]
                pieces.append(x[start : start + n, self._col_starts[i] : self._col_starts[i + 1]].reshape(-1))
                segments.append((n * w, w))
            send.append(segments)
        counts = state.group_counts
        recv = [[(counts[g] * w, w) for g, w in zip(layout.cell_group_on[k], layout.cell_widths_on[k])] for k in range(world)]
        recv_sizes = [sum(e for e, _ in segments) for segments in recv]
        ledger = self._ledger(received, counts) if self.comm_stats is not None else None
        payload = torch.cat(pieces) if pieces else local_embs.new_empty(0)
        vectors = all_to_all(payload, send, recv, self._pg, self._codecs, ledger)
        return NoWait(self._expand(vectors, recv_sizes, state))

    def _expand(self, vectors: torch.Tensor, recv_sizes: List[int], state: UniqueState) -> torch.Tensor:
        layout = self._layout
        counts = state.group_counts
        blocks: Dict[tuple[int, int], torch.Tensor] = {}
        for k, chunk in enumerate(torch.split(vectors, recv_sizes)):
            sizes = [counts[g] * w for g, w in zip(layout.cell_group_on[k], layout.cell_widths_on[k])]
            for i, (block, w) in enumerate(zip(torch.split(chunk, sizes), layout.cell_widths_on[k])):
                blocks[(k, i)] = block.view(-1, w)
        stride = state.stride
        lengths = state.lengths.view(len(layout.features), stride).long()
        per_feature_ids = lengths.sum(dim=1).tolist()
        id_start = 0
        key_start = 0
        outputs = []
        for f, per_row in enumerate(layout.assembly):
            rows = [torch.cat([blocks[cell] for cell in cols], dim=1) if len(cols) > 1 else blocks[cols[0]] for cols in per_row]
            table = torch.cat(rows) if len(rows) > 1 else rows[0]
            n_ids = per_feature_ids[f]
            index = state.inverse[id_start : id_start + n_ids] - key_start
            offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths[f], dim=0)])
            weights = state.weights[id_start : id_start + n_ids] if state.weights is not None else None
            # also when this rank has no IDs (table is empty): the output must reach the all-to-all, so
            # that this rank joins its backward exchange
            outputs.append(F.embedding_bag(index, table, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True))
            id_start += n_ids
            key_start += table.size(0)
        return torch.cat(outputs, dim=1)

    def _ledger(self, received: List[List[int]], counts: List[int]) -> Ledger:
        assert self.comm_stats is not None
        layout, me = self._layout, self._rank
        ledger = Ledger(self.comm_stats, self.comm_cluster, list(range(self._world)))
        position = {g: i for i, g in enumerate(layout.groups_on[me])}
        for s in range(self._world):
            for w, g in zip(layout.cell_widths_on[me], layout.cell_group_on[me]):
                n = received[s][position[g]]
                ledger.add(layout.tables[layout.group_feature[g]], s, False, n * w, n)
        for k in range(self._world):
            for w, g in zip(layout.cell_widths_on[k], layout.cell_group_on[k]):
                ledger.add(layout.tables[layout.group_feature[g]], k, True, counts[g] * w, counts[g])
        return ledger


class UniquePooledEmbeddingSharding(GridPooledEmbeddingSharding):
    """Embark's UB cluster: the grid's cells, with de-duplicating dists (module docstring)."""

    def _unique_layout(self) -> UniqueLayout:
        cells_on = [[self._cells[v] for v in names] for names in self.feature_names_per_rank()]
        return UniqueLayout.build(
            self._features,
            self._feature_tables,
            self._feature_dims,
            self._feature_rows,
            self._feature_mean,
            self._feature_bounds,
            cells_on,
            [list(map(int, dims)) for dims in self._emb_dim_per_rank_per_feature()],
        )

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        assert self._pg is not None
        names = self.feature_names_per_rank()[dist.get_rank(self._pg)]
        return UniqueSparseFeaturesDist(self._pg, self._unique_layout(), names, self._weighted)

    def create_output_dist(self, device: Optional[torch.device] = None) -> UniquePooledEmbeddingDist:  # type: ignore[override]
        assert self._pg is not None
        registry = self.qcomm_codecs_registry or {}
        return UniquePooledEmbeddingDist(self._pg, self._unique_layout(), registry.get(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name))
