"""The cost model: per-rank lookup work, intra/inter-node bytes, memory, and the step time.

Notation: W ranks in nodes of L, global batch B, b = B / W samples per rank. A table has F features,
each with `pooling` p IDs per sample; its row slice r holds the fraction m_r of the rows and so
receives m_r of the lookups and U_r = m_r x u x b x p distinct IDs from each rank per feature, u
being the table's unique ratio (ModelSpec.expected_unique_ratio). e_fwd / e_bwd: wire bytes per embedding element.

Per table and cluster (bytes are counted at the sender and at the receiver; each cluster kind's class in
layout/kinds.py computes its terms, traffic.py lists the same traffic message by message from the same kind
methods, and the runtime's dists send exactly that):
- RB input dist: every rank sends each cell's holder F x (b p m_r x i + b x 4) bytes (IDs of i
  bytes: 8 on TorchRec's sharding types, which send the input's int64 IDs, 4 on ours, which send
  row-local int32 IDs; int32 lengths), once per cell.
- RB output: every cell sends each other rank F x b x w_c x e_fwd bytes of partial sums.
  Hierarchical: a cell first sends its sums for destination j to the rank of its node whose local
  rank is j's (intra-node), which sums the node's cells and sends each column slice once across
  nodes, each rank to the ranks of its local rank (TorchRec's table-row-wise the same); the intra-node
  hop at wire.intra_node_reduction_precision of the layout's precision (fp32 for fp8), the cross-node
  one at the layout's. Backward: the same bytes in the opposite direction at e_bwd.
- UB: IDs are de-duplicated per destination: F x (U_r x 4 + 4) bytes in to each distinct holder
  of row slice r (IDs and one int32 count per feature), F x U_r x w_c x e_fwd bytes back from each
  cell (one vector per distinct ID), and the same back in backward at e_bwd.
- DP: every rank also updates every row of its copy each step (TorchRec's dense TBE makes a dense
  gradient, the dense optimizer steps all of it): rows x dim x dp_ns_per_element of host work (measured by
  python -m embark_torchrec.calibrate; 17 ns on the CPU box, zero in the GPU presets, where it streams
  through HBM). No forward traffic; the gradient (rows x dim x e_bwd bytes) is all-reduced as NCCL's ring
  all-reduce runs (its algorithm for large messages; tree and NVLS are not modelled): each rank sends
  2 (W-1)/W of it to its ring neighbour; with N > 1 nodes, 1/L of that crosses nodes (each ring
  channel leaves a node through a different GPU's NIC, so the node's L NICs share the inter-node
  hops) and the rest goes over NVLink. The hops are pipelined, so the all-reduce takes the slower of
  its NVLink and network times. The dense part's gradients (Hardware.dense_params_mb) alike.
- Lookup work (bytes through HBM): RB cell: B F p m_r x w_c x 4 bytes forward; UB cell:
  W F U_r x w_c x 4 on its owner, plus b F p x dim x 4 on every rank to expand the unique vectors
  back into its samples' bags; DP: b F p x dim x 4. Backward costs BACKWARD_COMPUTE_MULTIPLIER x forward.
  UB also costs every rank b F p x unique_ns_per_id for its own host work: de-duplication, routing
  the distinct IDs, the expansion back into bags (measured against table-wise on IDs that never
  repeat, python -m embark_torchrec.calibrate; zero in the GPU presets, where it runs on the device). Every
  ID a cell looks up (the same counts, without the width) also costs lookup_ns_per_id: indexing and
  pooling per ID, whatever its width, which is why a column split is not free on a CPU (zero in the GPU
  presets). A TBE's backward and its fused optimizer work per distinct row: each distinct row a cell
  touches in a step costs update_ns_per_row (zero in the presets, whose lookup_ns_per_id holds it). A
  cell of row slice r touches min(its rows, m_r x D) rows, D being the table's expected distinct IDs
  among the whole batch's B x F x p lookups (at most W x one rank's, by its unique ratio): on Zipf IDs
  over small tables far fewer than its IDs.
- Sequence tables (one vector per ID, not per bag; sharding/sequence.py): inputs as above; nothing
  is summed, so an RB cell (r, c) sends each other rank F x b x p x m_r x w_c x e_fwd bytes, one
  vector of its columns per ID of that rank in row slice r (m_r-weighted: a row split does not
  reduce), directly (a hierarchical layout runs flat); UB sends what it sends for pooled tables,
  and its expansion back into sequence order costs what the pooled one's into bags does; DP has no
  output traffic. An RB sequence table's sender works per ID as UB's does: it routes every ID and
  gathers each returning vector into its place (b F p x dim x 4 bytes, and b F p x unique_ns_per_id
  of host work, the same passes over the IDs as UB's de-duplication and expansion), so between RB
  and UB only the repeats differ: UB looks up, sends and updates each distinct ID once. Their
  sharding groups are other modules' than the pooled tables' (an EmbeddingCollection's), so they
  pay their collectives apart (a ShardingGroup's module).
- Memory per rank: per row of a cell, w_c x (4 + optimizer bytes per element) + optimizer bytes
  per row; DP tables in full on every rank.

- Collectives: each sharding group the plan runs (a ShardingGroup, one per distinct sharding-type
  string TorchRec sees, see groups.py) issues a fixed number of collectives per step, each costing
  collective_us to launch and synchronise, whatever its size (milliseconds on gloo; zero in the GPU presets). A
  data-parallel group issues one, its own DDP's all-reduce; each sharded module (the pooled
  tables' EBC, the sequence tables' EC) one split exchange, whatever its groups; the dense part's
  DDP one more.

Time per rank: lookup_ms = lookup bytes / HBM bandwidth + IDs x lookup_ns_per_id + de-duplication;
comm_ms = max(sent, received) intra / NVLink bandwidth + max(sent, received) inter / network bandwidth, or,
where a rank's phases do not overlap (Hardware.inter_node_phase_overlap < 1: the emulated cluster), the sum over
the step's phases (the input dists' IDs, the forward's vectors and partial sums, the backward's gradients) of each
one's max(sent, received) inter / network bandwidth (weighted by the overlap); the part of the inter-node bytes a
rank exchanges with its local rank's peers only (the hierarchical stage 2) runs at inter_node_paired_ratio x that
bandwidth instead: one pair of ranks per node pair carries it, and on gloo a pair is half duplex
(benchmarks/link_sharing.md). Where a node's ranks share one link (inter_node_solo_ratio > 1), a rank's inter-node
time is when its sends and receives are done, its node's ranks sharing the link by water filling
(shared_link_inter_ms). Where traffic one way runs faster than both ways (inter_node_one_way_ratio > 1: gloo's
half-duplex pairs), a rank's inter-node time takes the smaller of its sends and receives (in a phase) at the network
bandwidth and the rest at the ratio x it (both_ways). All-reduces cost the ring's bytes over the measured bus
bandwidth where there is one (allreduce_bus_gbps), else the ring's slowest link.
Step = max over ranks of lookup_ms
+ max over ranks of comm_ms + collective ms + DP all-reduce ms + dense ms (b / 1000 x
dense_ms_per_ksample, plus the dense all-reduce) - overlap, the same formulas for every plan. DDP
all-reduces its buckets (the DP tables' gradients and the dense part's) while the backward computes,
so the all-reduces hide behind the backward's share of the lookups and the dense compute
(BACKWARD_COMPUTE_MULTIPLIER / (1 + it) of them), up to their own length: overlap = min(all-reduces,
that share). They do not hide behind the embedding all-to-alls, which take the same links. When every rank
shares one host's cores (host_cores > 0: our CPU test box), the lookups take at least the sum over
ranks / host_cores: there, balancing the ranks does not shorten the step, less total work does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..model.constants import BACKWARD_COMPUTE_MULTIPLIER, WEIGHT_BYTES
from ..model.fields import TABLE_KINDS
from ..layout.groups import DENSE_COLLECTIVES, ShardingGroup, module_collectives_per_step, sharding_group
from ..layout.tables import Plan, TableLayout
from ..model.spec import IdDistribution, ModelSpec, TableSpec
from ..model.topology import Topology
from ..layout.wire import ELEMENT_BYTES
from .load import RankLoad

_LOAD_CACHE_SIZE = 16384
_RATIO_CACHE_SIZE = 1 << 17  # tables' unique ratios kept across cost models
_SUM_ELEMENTS = 1 << 17  # elements of a stack add_in_order sums: 1 MB, in cache (fastest at 256-1,024 ranks)


@dataclass(frozen=True)
class OptimizerMemory:
    """Optimizer state held next to each weight; default: torchrec's fused row-wise Adagrad."""

    bytes_per_element: float = 0.0
    bytes_per_row: float = 4.0


_unique_ratios: dict[tuple[TableSpec, int, IdDistribution, int], float] = {}


def _unique_ratio(spec: ModelSpec, table: TableSpec, world_size: int) -> float:
    """spec.expected_unique_ratio, memoised across cost models: a plan's report and lower bound price
    the model again in cost models of their own, and a Zipf table's expected distinct IDs take a
    millisecond (a minute at 50,000 tables)."""
    key = (table, spec.batch_size, spec.id_distribution, world_size)  # what the ratio depends on
    ratio = _unique_ratios.get(key)
    if ratio is None:
        if len(_unique_ratios) >= _RATIO_CACHE_SIZE:
            _unique_ratios.clear()
        ratio = _unique_ratios[key] = spec.expected_unique_ratio(table, world_size)
    return ratio


def _to_ms(nbytes: np.ndarray | float, gbps: float) -> np.ndarray | float:
    return nbytes / (gbps * 1e6)


@dataclass(frozen=True)
class StepCost:
    """The estimated step and its parts, with the per-rank arrays they come from."""

    lookup_ms: float
    comm_ms: float
    collective_ms: float
    dp_allreduce_ms: float
    dense_ms: float
    overlap_ms: float  # DDP's all-reduce (DP tables' and the dense part's) run during the backward's compute
    rank_lookup_ms: np.ndarray = field(repr=False)
    rank_intra_ms: np.ndarray = field(repr=False)
    rank_inter_ms: np.ndarray = field(repr=False)
    rank_memory: np.ndarray = field(repr=False)
    rank_intra_bytes: np.ndarray = field(repr=False)
    rank_inter_bytes: np.ndarray = field(repr=False)

    @property
    def step_ms(self) -> float:
        serial = self.lookup_ms + self.comm_ms + self.collective_ms + self.dp_allreduce_ms + self.dense_ms
        return serial - self.overlap_ms

    @property
    def rank_load_ms(self) -> np.ndarray:
        """What the search balances: each rank's lookups plus its embedding communication."""
        return self.rank_lookup_ms + self.rank_intra_ms + self.rank_inter_ms

    def parts(self) -> dict[str, float]:
        return {
            "step_ms": self.step_ms,
            "lookup_ms": self.lookup_ms,
            "comm_ms": self.comm_ms,
            "collective_ms": self.collective_ms,
            "dp_allreduce_ms": self.dp_allreduce_ms,
            "dense_ms": self.dense_ms,
            "overlap_ms": self.overlap_ms,
        }


def phases_inter(rows: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The inter-node (sent, received) bytes of RankLoad rows (or stacked columns of them) per phase of the step:
    the input dists' IDs, the forward's vectors and partial sums, the backward's gradients. The phases follow one
    another (each waits for the one before), so a rank's sends in one cannot overlap its receives in another."""
    send, recv, ids_send, ids_recv, grads_send, grads_recv = rows[3], rows[4], rows[10], rows[11], rows[12], rows[13]
    forward = (np.maximum(send - ids_send - grads_send, 0.0), np.maximum(recv - ids_recv - grads_recv, 0.0))
    return (ids_send, ids_recv), forward, (grads_send, grads_recv)


class CostModel:
    """Scores plans for one model on one topology; see the module docstring for the formulas."""

    def __init__(self, spec: ModelSpec, topology: Topology, optimizer: OptimizerMemory | None = None) -> None:
        if spec.batch_size % topology.world_size:
            raise ValueError(f"batch size {spec.batch_size} is not divisible by world size {topology.world_size}")
        self.spec = spec
        self.topology = topology
        self.optimizer = optimizer or OptimizerMemory()
        self.local_batch = spec.batch_size // topology.world_size
        self._tables: dict[str, TableSpec] = {t.name: t for t in spec.tables}
        self.unique_ratios: dict[str, float] = {}
        self._touched: dict[str, float] = {}  # per table: expected distinct IDs among a step's lookups (rows_touched)
        self._loads: dict[tuple[tuple, TableLayout], RankLoad] = {}
        # what a table's cost depends on: tables with equal signatures cost the same in any layout
        self.signature = {
            t.name: (t.rows, t.dim, t.pooling, len(t.feature_names), spec.distribution(t), t.unique_ratio, t.kind)
            for t in spec.tables
        }
        w, lws = topology.world_size, topology.local_world_size
        self._node = np.arange(w) // lws
        self._local = np.arange(w) % lws
        self._shifts: dict[int, np.ndarray] = {}
        self.computed = 0  # per-table loads computed in full (cache misses): work the scale tests count

    # ---- per-table building blocks -------------------------------------------------------

    def table(self, name: str) -> TableSpec:
        return self._tables[name]

    def row_mass(self, name: str, row_bounds: tuple[int, ...]) -> np.ndarray:
        """Fraction of the lookups per row slice: its fraction of the rows (IDs are hashed)."""
        return np.diff(np.asarray(row_bounds, dtype=np.float64)) / self._tables[name].rows

    def row_distinct(self, name: str, row_bounds: tuple[int, ...]) -> np.ndarray:
        """Expected distinct IDs per row slice among one rank's b x p draws of one feature."""
        t = self._tables[name]
        ratio = self.unique_ratios.get(name)
        if ratio is None:
            ratio = self.unique_ratios[name] = _unique_ratio(self.spec, t, self.topology.world_size)
        return ratio * self.local_batch * t.pooling * self.row_mass(name, row_bounds)

    def rows_touched(self, name: str, row_bounds: tuple[int, ...]) -> np.ndarray:
        """Expected distinct rows of each row slice that a step's lookups touch (all ranks, all features): the
        rows its backward and fused optimizer update."""
        t = self._tables[name]
        distinct = self._touched.get(name)
        if distinct is None:
            feats = len(t.feature_names)
            draws = self.spec.batch_size * t.pooling * feats
            every_rank = self.topology.world_size * float(self.row_distinct(name, (0, t.rows))[0]) * feats
            distinct = min(self.spec.distribution(t).expected_distinct(t.rows, draws), every_rank)
            self._touched[name] = distinct
        sizes = np.diff(np.asarray(row_bounds, dtype=np.float64))
        return np.minimum(sizes, distinct * self.row_mass(name, row_bounds))

    def update_ms(self, name: str, row_bounds: tuple[int, ...]) -> np.ndarray:
        """Per row slice, the ms its holder spends in the backward's and optimizer's per-row work each step."""
        per_row = self.topology.hardware.update_ns_per_row
        if not per_row:  # the presets: no term, and no distinct-ID estimate to compute
            return np.zeros(len(row_bounds) - 1)
        return self.rows_touched(name, row_bounds) * per_row / 1e6

    def row_memory(self, name: str, width: int) -> float:
        """Bytes per row of a cell `width` columns wide: weights + optimizer state."""
        return width * (WEIGHT_BYTES + self.optimizer.bytes_per_element) + self.optimizer.bytes_per_row

    def spread(self, load: RankLoad, to_all: np.ndarray, ids_in: np.ndarray, grads_in: np.ndarray) -> None:
        """Rank k sends to_all[k] bytes to every other rank (the forward's vectors or partial sums) and receives
        ids_in[k] (the input dist's IDs) and grads_in[k] (the backward's gradients) from each; the inter-node
        bytes of the IDs and of the gradients are also kept apart (RankLoad's _ids and _grads rows)."""
        lws, w = self.topology.local_world_size, self.topology.world_size
        for vec, send_i, recv_i, send_x, recv_x in (
            (to_all, load.send_intra, load.recv_intra, load.send_inter, load.recv_inter),
            (ids_in + grads_in, load.recv_intra, load.send_intra, load.recv_inter, load.send_inter),
            (ids_in, None, None, load.recv_inter_ids, load.send_inter_ids),
            (grads_in, None, None, load.recv_inter_grads, load.send_inter_grads),
        ):
            node_sum = vec.reshape(-1, lws).sum(axis=1)[self._node]
            send_x += (w - lws) * vec
            recv_x += vec.sum() - node_sum
            if send_i is not None and recv_i is not None:
                send_i += (lws - 1) * vec
                recv_i += node_sum - vec

    def hierarchical_to_all(
        self, load: RankLoad, column_holders: list[int], intra_bytes: float, cross_bytes: float, reverse: bool
    ) -> None:
        """Partial sums of one column slice, held by `column_holders` (one entry per cell), reduced
        to every rank node first: each cell sends its sums for destination j to the rank of its
        node with j's local rank (stage 1, intra-node, `intra_bytes` per destination); each node
        holding the column sends its sums once to every rank on another node (stage 2, `cross_bytes`;
        the hops' precisions may differ, wire.intra_node_reduction_precision). `reverse`: the
        gradients, the other way."""
        lws, nodes = self.topology.local_world_size, self.topology.num_nodes
        rows = (load.send_intra, load.recv_intra, load.send_inter, load.recv_inter, load.send_paired, load.recv_paired)
        send_i, recv_i, send_x, recv_x, send_p, recv_p = (
            (rows[1], rows[0], rows[3], rows[2], rows[5], rows[4]) if reverse else rows
        )
        for k in column_holders:
            n = int(self._node[k])
            here = slice(n * lws, (n + 1) * lws)
            send_i[k] += (lws - 1) * nodes * intra_bytes
            recv_i[here] += nodes * intra_bytes
            recv_i[k] -= nodes * intra_bytes
        phases = ((send_x, recv_x), (send_p, recv_p))
        if reverse:  # the gradients' bytes are also the backward phase's (rank_times)
            phases += ((load.recv_inter_grads, load.send_inter_grads),)
        for n in sorted({int(self._node[k]) for k in column_holders}):
            for send, recv in phases:
                send[n * lws : (n + 1) * lws] += (nodes - 1) * cross_bytes
                recv[: n * lws] += cross_bytes
                recv[(n + 1) * lws :] += cross_bytes

    def table_load(self, name: str, layout: TableLayout) -> RankLoad:
        """What one table adds to each rank (memoised by what the cost depends on, so identical
        tables share entries: the search prices the same layouts often; callers must not modify
        the result)."""
        key = (self.signature[name], layout)
        cached = self._loads.get(key)
        if cached is None:
            if len(self._loads) >= _LOAD_CACHE_SIZE:
                self._loads.pop(next(iter(self._loads)))
            cached = self._loads[key] = self._single_cell_load(name, layout) or self._table_load(name, layout)
        return cached

    def shifted_ranks(self, k: int) -> np.ndarray:
        """For a one-cell table on rank k: the rank whose load under the same table on rank 0 each
        rank takes (nodes and local ranks shifted, which keeps the node structure); memoised."""
        source = self._shifts.get(k)
        if source is None:
            lws, nodes = self.topology.local_world_size, self.topology.num_nodes
            source = self._shifts[k] = ((self._node - k // lws) % nodes) * lws + (self._local - k % lws) % lws
        return source

    def one_cell_columns(self, base: RankLoad) -> np.ndarray:
        """The [14, L + 1] columns of a one-cell table's load on rank 0 (`base`) that give its load on any
        rank (add_in_order): its node's L ranks, and one rank of another node (every rank off the
        holder's node takes the same load; L columns on one node)."""
        return base.rows[:, : self.topology.local_world_size + 1]

    def add_in_order(
        self, rows: np.ndarray, columns: np.ndarray, holders: np.ndarray, full: Mapping[int, np.ndarray]
    ) -> None:
        """rows += the loads of n tables, added one table after another in order, to the same bits as
        adding them one at a time: a one-cell table j on rank holders[j] adds its one_cell_columns
        columns[j] renumbered by shifted_ranks (its node's ranks shifted, the others one column), any
        other table (holders[j] < 0) the rows full[j]. A chunk of tables is stacked and summed along
        the stack's first axis, which numpy adds in order, element by element: no Python per table
        but for the tables of several cells."""
        lws, nodes = self.topology.local_world_size, self.topology.num_nodes
        local = np.arange(lws)
        chunk = max(1, _SUM_ELEMENTS // rows.size)
        for start in range(0, len(holders), chunk):
            ks = holders[start : start + chunk]
            stack = np.empty((len(ks) + 1,) + rows.shape)
            stack[0] = rows
            if nodes > 1:  # every table's off-node column, over every rank (the others' rows replace it)
                stack[1:] = columns[start : start + len(ks), :, lws : lws + 1]
            one = np.flatnonzero(ks >= 0)
            if len(one):
                cols, at = columns[start + one], ks[one]
                node_ranks = (at - at % lws)[:, None] + local
                shifted = (local - (at % lws)[:, None]) % lws
                stack[(one + 1)[:, None], :, node_ranks] = cols[np.arange(len(one))[:, None], :, shifted]
            for j in np.flatnonzero(ks < 0).tolist():
                stack[j + 1] = full[start + j]
            np.add.reduce(stack, axis=0, out=rows)

    def _single_cell_load(self, name: str, layout: TableLayout) -> RankLoad | None:
        """A one-cell table on rank k loads the ranks as the same table on rank 0 does, renumbered
        by shifted_ranks: one gather instead of the whole computation. The search prices thousands
        of such placements."""
        if layout.kind.replicated or layout.num_row_slices * layout.num_col_slices != 1 or layout.ranks[0][0] == 0:
            return None
        base = self.table_load(name, layout.with_ranks(((0,),)))
        return RankLoad(base.rows[:, self.shifted_ranks(layout.ranks[0][0])], base.dp_intra, base.dp_inter, base.groups)

    def _table_load(self, name: str, layout: TableLayout) -> RankLoad:
        """A table's load as its cluster kind prices it (layout/kinds.py), in the sharding group it runs in."""
        self.computed += 1
        t = self._tables[name]
        w = self.topology.world_size
        load = RankLoad.zeros(w)
        group = sharding_group(layout, t.rows, w, self.topology.local_world_size, t.is_sequence)
        load.groups[group] = 1
        layout.kind.add_load(self, name, layout, load, group.id_bytes)
        return load

    def cell_ms(self, name: str, layout: TableLayout) -> np.ndarray:
        """[R, C] estimate of what each cell costs the rank that holds it, for placing cells.

        Its lookups plus the traffic it makes its holder send or receive (IDs in, vectors or
        partial sums out and their gradients back), priced as if spread over the other ranks like
        a uniform all-to-all. Only the holder's side depends on placement: every rank receives
        partial sums from every holder wherever the holders are.
        """
        t = self._tables[name]
        topology = self.topology
        group = sharding_group(layout, t.rows, topology.world_size, topology.local_world_size, t.is_sequence)
        return layout.kind.cell_ms(self, name, layout, group.id_bytes)

    # ---- whole plans ----------------------------------------------------------------------

    def group_ms(self, group: ShardingGroup) -> float:
        """What one sharding group costs per step in collective launches."""
        return group.collectives_per_step * self.topology.collective_us / 1e3

    def collectives_ms(self, groups: Mapping[ShardingGroup, int]) -> float:
        """What a plan's sharding groups (RankLoad.groups) cost per step in collective launches: each group's
        own (group_ms) and one split exchange per sharded module holding any (the pooled tables' EBC, the
        sequence tables' EC)."""
        used = [group for group, n in groups.items() if n > 0]
        count = sum(module_collectives_per_step(g for g in used if g.module == module) for module in TABLE_KINDS)
        return count * self.topology.collective_us / 1e3

    @property
    def dense_compute_ms(self) -> float:
        """The dense part's forward + backward + optimizer on one rank's batch, scaled by the host's share on one
        shared host."""
        return self.local_batch / 1000.0 * self.topology.hardware.dense_ms_per_ksample * self.topology.host_share

    def rank_load(self, plan: Plan | Mapping[str, TableLayout]) -> RankLoad:
        tables = plan.tables if isinstance(plan, Plan) else plan
        return RankLoad.total((self.table_load(n, layout) for n, layout in tables.items()), self.topology.world_size)

    def rank_times(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Lookup, intra-node and inter-node ms of each column of RankLoad rows ([14, W], or any
        columns of such arrays stacked): elementwise, so a column costs the same bits here as in
        the whole array (the search prices single ranks of many tables at once). A rank's inter-node time is
        its step's max(sent, received) or, where phases do not overlap, the sum over the step's phases
        (phased_network_ms). The paired bytes pay
        the difference between the paired rate and the all-ranks one on top (none where they are equal,
        which keeps a hardware file without the paired figure's prices to the bit)."""
        hw = self.topology.hardware
        lookup_bytes, send_intra, recv_intra, _, _, _, host_ms, lookup_ids = rows[:8]  # as _ROWS
        lookup = _to_ms(lookup_bytes, hw.hbm_bw_gbps) + lookup_ids * hw.lookup_ns_per_id / 1e6 + host_ms
        intra = _to_ms(np.maximum(send_intra, recv_intra), hw.intra_node_bw_gbps)
        inter = self.phased_network_ms(rows[3], rows[4], lambda: phases_inter(rows))
        if hw.inter_node_paired_ratio != 1.0:
            inter = inter + np.maximum(rows[8], rows[9]) * self.paired_premium_ms_per_byte
        return lookup, intra, inter

    def phased_network_ms(
        self,
        sent: np.ndarray,
        received: np.ndarray,
        phases: Callable[[], tuple[tuple[np.ndarray, np.ndarray], ...]],
    ) -> np.ndarray:
        """A rank's network ms for the step's sends and receives (`sent`, `received`) and the same per phase
        (`phases`, as phases_inter gives them; called only where they are priced): the phases in turn, and the
        step's as a whole where they overlap, weighted by Hardware.inter_node_phase_overlap (1: the whole step's
        alone, to the bit, and the search's hot path computes no phase)."""
        overlap = self.topology.hardware.inter_node_phase_overlap
        whole = self.network_ms(sent, received)
        if overlap == 1.0:
            return whole
        in_turn = sum((self.network_ms(s, r) for s, r in phases()), np.zeros_like(whole))
        return overlap * whole + (1.0 - overlap) * in_turn

    def network_ms(self, sent: np.ndarray, received: np.ndarray) -> np.ndarray:
        """A rank's ms on the network for its inter-node sends and receives, at the all-ranks rate (both_ways), before
        any sharing of a node's link or paired premium."""
        return _to_ms(self.both_ways(sent, received), self.topology.hardware.inter_node_bw_gbps)

    def both_ways(self, sent: np.ndarray, received: np.ndarray) -> np.ndarray:
        """A rank's inter-node sends and receives as bytes at the both-ways rate: the smaller of the two, and what the
        larger has beyond it at the one-way rate (Hardware.inter_node_one_way_ratio; 1: the larger, as before)."""
        ratio = self.topology.hardware.inter_node_one_way_ratio
        if ratio == 1.0:
            return np.maximum(sent, received)
        low = np.minimum(sent, received)
        return low + (np.maximum(sent, received) - low) / ratio

    @property
    def paired_premium_ms_per_byte(self) -> float:
        """What a paired inter-node byte costs over an all-ranks one (negative where pairs run faster)."""
        hw = self.topology.hardware
        return (1.0 / hw.inter_node_paired_ratio - 1.0) / (hw.inter_node_bw_gbps * 1e6)

    def ring_allreduce_bytes(self, nbytes: float) -> tuple[float, float]:
        """(intra-node, inter-node) bytes one rank sends to all-reduce `nbytes` as NCCL's ring does.

        Every rank sends 2 (W-1)/W x nbytes to its ring neighbour, in channels that each cross every
        node boundary once; with several nodes, each channel leaves a node through a different GPU's
        NIC, so a rank sends 1/L of its ring bytes across nodes (N of a channel's W hops, spread over
        the node's L NICs) and the rest over NVLink. One node: every hop is intra-node."""
        w, lws = self.topology.world_size, self.topology.local_world_size
        ring = 2.0 * (w - 1) / w * nbytes
        inter = ring / lws if self.topology.num_nodes > 1 else 0.0
        return ring - inter, inter

    def ring_allreduce_ms(self, intra: float, inter: float) -> float:
        """At the measured all-reduce bus bandwidth where there is one (Hardware.allreduce_bus_gbps: the ring's
        bytes per rank over it); else a ring's hops run at once, pipelined chunk by chunk: its slowest link's time."""
        hw = self.topology.hardware
        if hw.allreduce_bus_gbps > 0:
            return _to_ms(intra + inter, hw.allreduce_bus_gbps)
        return max(_to_ms(intra, hw.intra_node_bw_gbps), _to_ms(inter, hw.inter_node_bw_gbps))

    def rank_load_ms(self, rows: np.ndarray) -> np.ndarray:
        """StepCost.rank_load_ms of RankLoad rows (or stacked columns of them), without the rest."""
        lookup, intra, inter = self.rank_times(rows)
        return lookup + intra + inter

    def drained(self, sent: np.ndarray) -> np.ndarray:
        """When each rank's inter-node bytes (`sent`, or received) are through its node's shared link, in bytes at the
        all-ranks rate: the node's ranks drain together, each at the all-ranks rate while all are busy; as ranks
        finish, the rest speed up to the solo ratio x that rate, the link's whole rate at most (water filling: with k
        of L ranks busy, each runs at min(solo, L / k))."""
        top = self.topology
        nodes, lws = top.num_nodes, top.local_world_size
        busy = np.arange(lws, 0, -1)  # ranks still sending during the i-th interval of a node's sorted loads
        rate = np.minimum(top.hardware.inter_node_solo_ratio, lws / busy)
        by_node = sent.reshape(nodes, lws)
        order = np.argsort(by_node, axis=1, kind="stable")
        ordered = np.take_along_axis(by_node, order, axis=1)
        steps = np.diff(ordered, axis=1, prepend=0.0) / rate
        done = np.empty_like(by_node)
        np.put_along_axis(done, order, np.cumsum(steps, axis=1), axis=1)
        return done.reshape(-1)

    def shares_links(self) -> bool:
        """Whether a node's ranks share one link (Hardware.inter_node_solo_ratio > 1, several nodes)."""
        return self.topology.hardware.inter_node_solo_ratio != 1.0 and self.topology.num_nodes > 1

    def shared_link_inter_ms(self, rows: np.ndarray) -> np.ndarray:
        """Each rank's inter-node ms where a node's ranks share one link (Hardware.inter_node_solo_ratio > 1): its
        ranks' sends (and, apart, their receives) drain together (drained); a rank's time is when its sends or its
        receives finish, whichever is later, plus its paired premium as in rank_times."""
        hw = self.topology.hardware

        def phases() -> tuple[tuple[np.ndarray, np.ndarray], ...]:
            return tuple((self.drained(sent), self.drained(received)) for sent, received in phases_inter(rows))

        inter = self.phased_network_ms(self.drained(rows[3]), self.drained(rows[4]), phases)
        if hw.inter_node_paired_ratio != 1.0:
            inter = inter + np.maximum(rows[8], rows[9]) * self.paired_premium_ms_per_byte
        return inter

    def phase_network_ms(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """Each rank's network ms in each phase of the step (phases_inter: the input dists' IDs, the forward's vectors
        and partial sums, the backward's gradients), its node's ranks sharing the link where they do, before any
        paired premium: where phases do not overlap (Hardware.inter_node_phase_overlap 0) the step's inter-node time
        is their sum; benchmarks/step_stages.py sets each beside the waits measured in training."""
        shared = self.shares_links()
        return tuple(
            self.network_ms(self.drained(sent), self.drained(received)) if shared else self.network_ms(sent, received)
            for sent, received in phases_inter(rows)
        )

    def step_cost(self, load: RankLoad, allreduce_precision: str = "fp32") -> StepCost:
        """The step of a plan's load; `allreduce_precision`: DDP's, at which the dense gradients travel
        (Plan.allreduce_precision; the data-parallel tables' are priced by their layouts)."""
        hw = self.topology.hardware
        lookup, intra, inter = self.rank_times(load.rows)
        if self.shares_links():
            inter = self.shared_link_inter_ms(load.rows)
        dp = self.ring_allreduce_ms(load.dp_intra, load.dp_inter)
        dense_bytes = hw.dense_params_mb * 1e6 / WEIGHT_BYTES * ELEMENT_BYTES[allreduce_precision]
        dense_ar = self.ring_allreduce_ms(*self.ring_allreduce_bytes(dense_bytes))
        if hw.dense_params_mb > 0:
            dense_ar += DENSE_COLLECTIVES * self.topology.collective_us / 1e3
        slowest = float(lookup.max())
        lookup_ms = max(slowest, float(lookup.sum()) / hw.host_cores) if hw.host_cores else slowest
        dense_compute = self.dense_compute_ms
        backward = (lookup_ms + dense_compute) * BACKWARD_COMPUTE_MULTIPLIER / (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
        return StepCost(
            lookup_ms=lookup_ms,
            comm_ms=float((intra + inter).max()),
            collective_ms=self.collectives_ms(load.groups),
            dp_allreduce_ms=float(dp),
            dense_ms=dense_compute + dense_ar,
            overlap_ms=min(float(dp) + dense_ar, backward),
            rank_lookup_ms=lookup,
            rank_intra_ms=intra,
            rank_inter_ms=inter,
            rank_memory=load.memory.copy(),
            rank_intra_bytes=load.send_intra + load.recv_intra,
            rank_inter_bytes=load.send_inter + load.recv_inter,
        )

    def evaluate(self, plan: Plan) -> StepCost:
        return self.step_cost(self.rank_load(plan), plan.allreduce_precision)
