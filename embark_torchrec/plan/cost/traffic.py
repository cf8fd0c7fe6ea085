"""The cost model's communication, message by message: what the runtime's dists send for one table.

CostModel prices a layout with closed forms over expected counts; this module lists the same
traffic as (sender, receiver, kind, bytes) messages, from expected counts or from a real batch's
counts (IDs per row slice for RB, distinct IDs per row slice for UB, per sender and feature). The
closed forms equal these messages summed (tests), and the runtime's counted bytes equal them for a
real batch (tests), which ties the planner's numbers to what runs.

What each cluster sends (F features, b samples per rank, cell (r, c) of width w_c on rank k; the kind's class
in layout/kinds.py says which IDs go to whom and whether vectors or partial sums come back):
- RB input: every rank s sends each cell's holder k its IDs of row slice r (int64 on TorchRec's
  sharding types, row-local int32 on ours: groups.id_bytes) and F x b bag lengths (int32), once per cell.
- RB output, flat: each cell's partial sums, F x b x w_c per destination; gradients back.
  Hierarchical: stage 1 sends a cell's partial sums for destination j to the rank of k's node with
  j's local rank (intra-node, unless that is k), at wire.intra_node_reduction_precision of the layout's
  precision (fp32 for fp8); stage 2 sends each node's sums of column slice c once to every destination
  on another node (from the rank with the destination's local rank), at the layout's precision.
- RB output of a sequence table: each cell sends s one vector of w_c per ID of s in its row slice,
  directly (nothing is summed, so a hierarchical layout runs flat); gradients back.
- UB (pooled or sequence): every rank s sends each distinct holder of row slice r one int32 count per feature and its
  distinct IDs of r (row-local int32); each cell sends s one vector of w_c per distinct ID of s; gradients
  back the same way.

Per sharded module rather than per table: its split exchange (split_exchange_messages), which the cost model
prices as one collective (groups.INPUT_EXCHANGE_COLLECTIVES), not by its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import CostModel
from ..layout.wire import intra_node_reduction_precision, split_exchange_bytes, vector_bytes
from ..layout.groups import sharding_group
from ..layout.tables import TableLayout


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    kind: str  # "ids", "lengths", "embeddings", "gradients" or "metadata", as comm_stats counts them
    nbytes: float


def split_exchange_messages(world_size: int, groups: int) -> list[Message]:
    """One batch's split exchange of a sharded module of `groups` sharding groups (sharding/input_exchange.py): every
    rank sends every other rank the groups' split sizes and its input-fault record (wire.split_exchange_bytes)."""
    nbytes = float(split_exchange_bytes(groups))
    return [Message(s, d, "metadata", nbytes) for s in range(world_size) for d in range(world_size) if s != d]


def expected_ids(cost: CostModel, name: str, layout: TableLayout) -> np.ndarray:
    """[W, F, R] the IDs (RB) or distinct IDs (UB) each rank sends per feature and row slice, as
    the cost model expects them."""
    t = cost.table(name)
    per_slice = layout.kind.ids_per_slice(cost, name, layout.row_bounds)
    return np.broadcast_to(per_slice, (cost.topology.world_size, len(t.feature_names), layout.num_row_slices)).copy()


def table_messages(cost: CostModel, name: str, layout: TableLayout, ids: np.ndarray | None = None) -> list[Message]:
    """Every message one step of this table sends (none to oneself); `ids` as expected_ids."""
    kind = layout.kind
    if kind.replicated:
        return []
    ids = expected_ids(cost, name, layout) if ids is None else np.asarray(ids, dtype=np.float64)
    t = cost.table(name)
    topo = cost.topology
    w, lws = topo.world_size, topo.local_world_size
    b, feats = cost.local_batch, len(t.feature_names)
    widths = np.diff(layout.col_bounds)
    fwd, bwd = layout.precision.forward, layout.precision.backward
    per_id = sharding_group(layout, t.rows, w, lws, t.is_sequence).id_bytes
    msgs: list[Message] = []
    cells = [(r, c, layout.ranks[r][c]) for r in range(layout.num_row_slices) for c in range(layout.num_col_slices)]
    # the IDs and their lengths (or counts) to each receiver of a row slice
    inputs = [
        (r, k, feats * kind.count_bytes(b))
        for r in range(layout.num_row_slices)
        for k in kind.input_receivers(layout.ranks[r])
    ]
    for r, k, lengths in inputs:
        for s in range(w):
            msgs.append(Message(s, k, "lengths", lengths))
            msgs.append(Message(s, k, "ids", ids[s, :, r].sum() * per_id))
    if kind.returns_vectors(t):  # one vector per (distinct) ID, straight back to its sender
        for r, c, k in cells:
            for s in range(w):
                vectors = ids[s, :, r].sum()
                msgs.append(Message(k, s, "embeddings", vectors * vector_bytes(int(widths[c]), fwd)))
                msgs.append(Message(s, k, "gradients", vectors * vector_bytes(int(widths[c]), bwd)))
        return [m for m in msgs if m.src != m.dst]
    for prec, kind in ((fwd, "embeddings"), (bwd, "gradients")):
        hops: list[tuple[int, int, float]] = []
        stage1 = intra_node_reduction_precision(prec) if layout.hierarchical else prec
        for r, c, k in cells:
            x = feats * b * vector_bytes(int(widths[c]), stage1)
            for j in range(w):
                hops.append((k, topo.aggregator(topo.node_of(k), j) if layout.hierarchical else j, x))
        if layout.hierarchical:
            for c in range(layout.num_col_slices):
                x = feats * b * vector_bytes(int(widths[c]), prec)
                for n in sorted({topo.node_of(layout.ranks[r][c]) for r in range(layout.num_row_slices)}):
                    for j in range(w):
                        if topo.node_of(j) != n:
                            hops.append((topo.aggregator(n, j), j, x))
        for src, dst, x in hops:
            msgs.append(Message(src, dst, kind, x) if kind == "embeddings" else Message(dst, src, kind, x))
    return [m for m in msgs if m.src != m.dst]
