"""Cluster kinds: one registered object per EMBark cluster kind, owning everything that differs between kinds.

A layout names its kind by `TableLayout.cluster`, the kind's `name` in plan files. The kind says
- which TorchRec sharding type runs a layout exactly, if any (else ours does, "embark_<name>[_hier]");
- how many collectives one sharding group of ours of it issues per training step;
- what its dists send for one table, in wire.py's bytes: the terms CostModel prices (add_load, cell_ms)
  and traffic.py lists message by message (ids_per_slice, input_receivers, count_bytes, returns_vectors);
- the layouts the lower bound tries for it (bound.py), and how a report names its shapes.
The runtime side of a kind, the EmbeddingSharding that runs it inside DMP, registers against the kind's class
in sharding/cluster_runtimes.py, so plan/ stays free of torch.

Built-in kinds: data-parallel ("dp"), reduction-based ("rb": partial sums of row slices summed at the receiver,
flat or hierarchical by the layout's flag) and unique-based ("ub": de-duplicated IDs, one vector per distinct ID
back), each for pooled and sequence tables. Adding a kind: subclass one, give it a `name`, register an instance
(register_cluster_kind); nothing else changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from ..model.constants import BACKWARD_COMPUTE_MULTIPLIER, WEIGHT_BYTES
from .torchrec_types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DATA_PARALLEL_COLLECTIVES,
    FLAT_COLLECTIVES,
    HIERARCHICAL_COLLECTIVES,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    ceil_row_bounds,
)
from .wire import LENGTH_BYTES, intra_node_reduction_precision, vector_bytes

if TYPE_CHECKING:
    from ..cost.load import RankLoad
    from ..model.spec import ModelSpec, TableSpec
    from ..model.topology import Topology
    from .tables import TableLayout

# collectives per step of one unique-based group: its de-duplicated IDs go through the KJT all-to-all (their
# counts are the KJT's lengths), then the vectors and their gradients
UNIQUE_COLLECTIVES = 4


@runtime_checkable
class PricingContext(Protocol):
    """What a kind prices one table with: the members of the cost model (CostModel) that the kinds call, and no
    others. A kind is a strategy that uses the cost model as its toolbox; declaring the toolbox here keeps kinds.py
    below the cost model, and a change to CostModel that breaks a kind fails on this contract
    (tests/test_plan_cost.py), not when a test happens to price that kind."""

    spec: ModelSpec
    topology: Topology
    local_batch: int

    def table(self, name: str) -> TableSpec: ...

    def row_mass(self, name: str, row_bounds: tuple[int, ...]) -> np.ndarray: ...

    def row_distinct(self, name: str, row_bounds: tuple[int, ...]) -> np.ndarray: ...

    def update_ms(self, name: str, row_bounds: tuple[int, ...]) -> np.ndarray: ...

    def row_memory(self, name: str, width: int) -> float: ...

    def spread(self, load: RankLoad, to_all: np.ndarray, ids_in: np.ndarray, grads_in: np.ndarray) -> None: ...

    def hierarchical_to_all(
        self, load: RankLoad, column_holders: list[int], intra_bytes: float, cross_bytes: float, reverse: bool
    ) -> None: ...

    def ring_allreduce_bytes(self, nbytes: float) -> tuple[float, float]: ...


class ClusterKind:
    """The interface of a cluster kind; the defaults are a sharded kind's (a grid of cells, each on one rank)."""

    name: ClassVar[str] = ""
    replicated: ClassVar[bool] = False
    """Every rank holds the whole table: no grid and no dists (DDP all-reduces its gradients)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ---- which sharding runs it, and its collectives ----------------------------------------------------

    def builtin_sharding_type(
        self, layout: TableLayout, rows: int, world_size: int, local_world_size: int
    ) -> str | None:
        """The TorchRec sharding type that runs this layout exactly, or None (ours runs it)."""
        return None

    def fp8_builtin_type(self, layout: TableLayout) -> str | None:
        """The TorchRec sharding type that may run this layout at a row-scaled precision (fp8), one group per row
        width, where the layout's `torchrec_at_fp8` says so; None: ours always runs it at fp8."""
        return None

    def collectives_per_step(self, hierarchical: bool) -> int:
        """Collectives one sharding group of ours of this kind issues per training step."""
        raise NotImplementedError(f"cluster kind {self.name!r} has no sharding of ours")

    def hierarchy_options(self, row_slices: int) -> tuple[bool, ...]:
        """The values of a layout's hierarchical flag worth trying for this many row slices: only kinds whose row
        slices' partial sums meet (reduction-based, two or more row slices) may reduce inside each node first."""
        return (False,)

    def fewest_collectives(self) -> int:
        """The fewest collectives any sharding group of this kind issues per step (the lower bound's)."""
        return min(self.collectives_per_step(False), self.collectives_per_step(True))

    def bound_grids(self, row_slices: int) -> list[tuple[int, bool]]:
        """(row slices, hierarchical) of the grids, of at least `row_slices` row slices, whose least cost no
        layout of a table of this kind beats (bound.py places every cell on rank 0)."""
        return [(row_slices, False)]

    def shape_name(self, shape: str) -> str:
        """How a report names a layout of this kind of the shape tw, cw, rw or grid."""
        return f"{self.name}-{shape}"

    # ---- what its dists send for one table ------------------------------------------------------------

    def ids_per_slice(self, cost: PricingContext, name: str, row_bounds: Sequence[int]) -> np.ndarray:
        """[R] the IDs each rank sends per feature to each row slice's holders."""
        t = cost.table(name)
        return cost.local_batch * t.pooling * cost.row_mass(name, row_bounds)

    def input_receivers(self, slice_ranks: Sequence[int]) -> list[int]:
        """The ranks a row slice's IDs go to, once each time listed: every cell's holder."""
        return list(slice_ranks)

    def count_bytes(self, local_batch: int) -> int:
        """Bytes per feature sent with a row slice's IDs to each receiver: one int32 length per bag."""
        return local_batch * LENGTH_BYTES

    def returns_vectors(self, table: TableSpec) -> bool:
        """Whether each cell sends one vector per ID straight back to its sender (else partial sums of bags)."""
        return table.is_sequence

    def add_load(self, cost: PricingContext, name: str, layout: TableLayout, load: RankLoad, id_bytes: int) -> None:
        """What one table of this kind adds to each rank (CostModel.table_load): lookups, memory, host work and
        bytes; `id_bytes`: per ID its input dist sends (groups.id_bytes)."""
        t = cost.table(name)
        w = cost.topology.world_size
        feats = len(t.feature_names)
        b = cost.local_batch
        fwd, bwd = layout.precision.forward, layout.precision.backward
        lookup_factor = WEIGHT_BYTES * (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
        rows = layout.row_bounds
        mass = cost.row_mass(name, rows)
        ids = self.ids_per_slice(cost, name, rows)
        updates_ms = cost.update_ms(name, rows)
        widths = np.diff(layout.col_bounds)
        to_all, ids_in, grads_in = np.zeros(w), np.zeros(w), np.zeros(w)
        # every rank de-duplicates its IDs and expands the unique vectors back into its bags (UB), or
        # routes each ID of a sequence table and gathers its returning vector into place (sequence RB)
        if self.returns_vectors(t):
            load.lookup_bytes += b * feats * t.pooling * t.dim * lookup_factor
            load.lookup_ids += b * feats * t.pooling
            load.host_ms += b * feats * t.pooling * cost.topology.hardware.unique_ns_per_id / 1e6
        for r in range(layout.num_row_slices):
            n_rows = rows[r + 1] - rows[r]
            for k in self.input_receivers(layout.ranks[r]):
                ids_in[k] += feats * (ids[r] * id_bytes + self.count_bytes(b))
            for c, k in enumerate(layout.ranks[r]):
                width = int(widths[c])
                load.memory[k] += n_rows * cost.row_memory(name, width)
                load.host_ms[k] += updates_ms[r]
                self._add_cell(cost, t, load, to_all, grads_in, ids[r], mass[r], width, k, fwd, bwd)
        self._add_outputs(cost, t, layout, load, to_all, grads_in, ids, widths)
        cost.spread(load, to_all, ids_in, grads_in)

    def _add_cell(
        self,
        cost: PricingContext,
        t: TableSpec,
        load: RankLoad,
        to_all: np.ndarray,
        grads_in: np.ndarray,
        ids: float,
        mass: float,
        width: int,
        k: int,
        fwd: str,
        bwd: str,
    ) -> None:
        """One cell's lookups on its holder k (and what it sends, where that is per cell)."""
        raise NotImplementedError

    def _add_outputs(
        self,
        cost: PricingContext,
        t: TableSpec,
        layout: TableLayout,
        load: RankLoad,
        to_all: np.ndarray,
        grads_in: np.ndarray,
        ids: np.ndarray,
        widths: np.ndarray,
    ) -> None:
        """The output dist's bytes where they are not per cell."""

    def cell_ms(self, cost: PricingContext, name: str, layout: TableLayout, id_bytes: int) -> np.ndarray:
        """[R, C] estimate of what each cell costs the rank that holds it, for placing cells (CostModel.cell_ms);
        `id_bytes` as add_load's."""
        t = cost.table(name)
        hw, w, lws = cost.topology.hardware, cost.topology.world_size, cost.topology.local_world_size
        b, feats = cost.local_batch, len(t.feature_names)
        ids = self.ids_per_slice(cost, name, layout.row_bounds)
        vectors = ids if self.returns_vectors(t) else np.full_like(ids, float(b))
        widths = np.diff(np.asarray(layout.col_bounds))
        fwd, bwd = layout.precision.forward, layout.precision.backward
        wire = np.array([vector_bytes(int(x), fwd) + vector_bytes(int(x), bwd) for x in widths])
        per_peer = feats * (ids * id_bytes + self._placement_count_bytes(b))[:, None] + feats * vectors[:, None] * wire
        peers_ms = (lws - 1) / (hw.intra_node_bw_gbps * 1e6) + (w - lws) / (hw.inter_node_bw_gbps * 1e6)
        looked_up = self._looked_up_ids(cost, name, layout.row_bounds, ids)
        lookup = feats * looked_up[:, None] * widths[None, :] * WEIGHT_BYTES * (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
        per_id = feats * looked_up[:, None] * hw.lookup_ns_per_id / 1e6
        updates = cost.update_ms(name, layout.row_bounds)[:, None]
        return lookup / (hw.hbm_bw_gbps * 1e6) + per_id + updates + per_peer * peers_ms

    def _placement_count_bytes(self, local_batch: int) -> int:
        """cell_ms's count bytes per feature (it prices a cell's share; a count per receiver is left out)."""
        return self.count_bytes(local_batch)

    def _looked_up_ids(self, cost: PricingContext, name: str, row_bounds: Sequence[int], ids: np.ndarray) -> np.ndarray:
        """[R] IDs per feature a cell of each row slice looks up per step (of every rank's batch)."""
        t = cost.table(name)
        return cost.spec.batch_size * t.pooling * cost.row_mass(name, row_bounds)


class DataParallelKind(ClusterKind):
    """Data-parallel: every rank holds the whole table and looks up its own batch; DDP all-reduces the gradients
    (TorchRec's data-parallel sharding runs it at every precision)."""

    name = "dp"
    replicated = True

    def builtin_sharding_type(self, layout: TableLayout, rows: int, world_size: int, local_world_size: int) -> str:
        return DATA_PARALLEL

    def collectives_per_step(self, hierarchical: bool) -> int:
        return DATA_PARALLEL_COLLECTIVES

    def shape_name(self, shape: str) -> str:
        return self.name

    def add_load(self, cost: PricingContext, name: str, layout: TableLayout, load: RankLoad, id_bytes: int) -> None:
        t = cost.table(name)
        feats, b = len(t.feature_names), cost.local_batch
        lookup_factor = WEIGHT_BYTES * (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
        load.lookup_bytes += b * feats * t.pooling * t.dim * lookup_factor
        load.lookup_ids += b * feats * t.pooling
        load.memory += t.rows * cost.row_memory(name, t.dim)
        load.host_ms += t.rows * t.dim * cost.topology.hardware.dp_ns_per_element / 1e6
        load.dp_intra, load.dp_inter = cost.ring_allreduce_bytes(
            t.rows * vector_bytes(t.dim, layout.precision.backward)
        )


class ReductionKind(ClusterKind):
    """Reduction-based: each cell looks up the IDs of its row slice from every rank and sends back partial sums of
    its columns per bag, summed at the receiver, directly (flat) or inside each node first (hierarchical); a
    sequence table's cells send one vector per ID instead. TorchRec's table-wise, column-wise, row-wise and
    table-row-wise run the layouts they express, at every element-wise wire precision."""

    name = "rb"

    def builtin_sharding_type(
        self, layout: TableLayout, rows: int, world_size: int, local_world_size: int
    ) -> str | None:
        """RW and TWRW only when the row bounds are TorchRec's own ceil blocks on the ranks it would use (its
        bucketizer ignores our bounds), none of them empty (a 0-row shard crashes the CPU TBE). At a row-scaled wire
        precision (fp8), only where the layout chooses TorchRec's (fp8_builtin_type)."""
        if layout.precision.row_scaled:
            return self.fp8_builtin_type(layout) if layout.torchrec_at_fp8 else None
        n_r, n_c = layout.num_row_slices, layout.num_col_slices
        if n_r == 1:
            return TABLE_WISE if n_c == 1 else COLUMN_WISE
        if n_c != 1:
            return None
        ranks = [row[0] for row in layout.ranks]
        if n_r == world_size and ranks == list(range(world_size)) and not layout.hierarchical:
            return ROW_WISE if layout.row_bounds == ceil_row_bounds(rows, world_size) else None
        first = ranks[0]
        node_ranks = list(range(first, first + local_world_size))
        if n_r == local_world_size and first % local_world_size == 0 and ranks == node_ranks and layout.hierarchical:
            return TABLE_ROW_WISE if layout.row_bounds == ceil_row_bounds(rows, local_world_size) else None
        return None

    def fp8_builtin_type(self, layout: TableLayout) -> str | None:
        """TW and CW of column slices of one width: TorchRec's dists size a message by its element count, so a
        row-scaled codec on them is told its group's one row width (groups.sharding_type). Not RW or TWRW: they
        reduce-scatter partial sums, which TorchRec sends at fp16 / bf16 for FP8 (its get_qcomm_codecs_registry);
        ours sends them at fp8 in an all-to-all."""
        if layout.num_row_slices != 1 or len(set(np.diff(layout.col_bounds).tolist())) != 1:
            return None
        return TABLE_WISE if layout.num_col_slices == 1 else COLUMN_WISE

    def collectives_per_step(self, hierarchical: bool) -> int:
        return HIERARCHICAL_COLLECTIVES if hierarchical else FLAT_COLLECTIVES

    def hierarchy_options(self, row_slices: int) -> tuple[bool, ...]:
        return (False, True) if row_slices > 1 else (False,)

    def bound_grids(self, row_slices: int) -> list[tuple[int, bool]]:
        """The fewest row slices and two of ours (4-byte IDs), each flat and hierarchical."""
        return [
            (n, hierarchical)
            for n in sorted({row_slices, max(row_slices, 2)})
            for hierarchical in self.hierarchy_options(n)
        ]

    def shape_name(self, shape: str) -> str:
        return shape

    def _add_cell(
        self,
        cost: PricingContext,
        t: TableSpec,
        load: RankLoad,
        to_all: np.ndarray,
        grads_in: np.ndarray,
        ids: float,
        mass: float,
        width: int,
        k: int,
        fwd: str,
        bwd: str,
    ) -> None:
        feats = len(t.feature_names)
        lookup_factor = WEIGHT_BYTES * (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
        load.lookup_bytes[k] += cost.spec.batch_size * feats * t.pooling * mass * width * lookup_factor
        load.lookup_ids[k] += cost.spec.batch_size * feats * t.pooling * mass

    def _add_outputs(
        self,
        cost: PricingContext,
        t: TableSpec,
        layout: TableLayout,
        load: RankLoad,
        to_all: np.ndarray,
        grads_in: np.ndarray,
        ids: np.ndarray,
        widths: np.ndarray,
    ) -> None:
        """Sequence: one vector per ID, straight back to its sender (flat even if hierarchical); pooled: partial
        sums of every cell's columns to every rank, flat or reduced inside each node first."""
        feats, b = len(t.feature_names), cost.local_batch
        fwd, bwd = layout.precision.forward, layout.precision.backward
        if self.returns_vectors(t):
            mass = cost.row_mass(t.name, layout.row_bounds)
            for r in range(layout.num_row_slices):
                for c, k in enumerate(layout.ranks[r]):
                    vectors = feats * b * t.pooling * mass[r]
                    to_all[k] += vectors * vector_bytes(int(widths[c]), fwd)
                    grads_in[k] += vectors * vector_bytes(int(widths[c]), bwd)
            return
        for c in range(layout.num_col_slices):
            holders = [layout.ranks[r][c] for r in range(layout.num_row_slices)]
            width = int(widths[c])
            for prec, direct, reverse in ((fwd, to_all, False), (bwd, grads_in, True)):
                nbytes = feats * b * vector_bytes(width, prec)
                if layout.hierarchical:
                    intra = feats * b * vector_bytes(width, intra_node_reduction_precision(prec))
                    cost.hierarchical_to_all(load, holders, intra, nbytes, reverse)
                else:
                    np.add.at(direct, holders, nbytes)


class UniqueKind(ClusterKind):
    """Unique-based: every rank de-duplicates its IDs per row slice and sends each distinct holder the distinct
    IDs and one count per feature; each cell sends back one vector per distinct ID, and every rank expands them
    into its bags (or its sequence). Always ours."""

    name = "ub"

    def collectives_per_step(self, hierarchical: bool) -> int:
        return UNIQUE_COLLECTIVES

    def ids_per_slice(self, cost: PricingContext, name: str, row_bounds: Sequence[int]) -> np.ndarray:
        return cost.row_distinct(name, row_bounds)

    def input_receivers(self, slice_ranks: Sequence[int]) -> list[int]:
        """Each distinct holder of the row slice once."""
        return sorted(set(slice_ranks))

    def count_bytes(self, local_batch: int) -> int:
        """One int32 count per feature."""
        return LENGTH_BYTES

    def returns_vectors(self, table: TableSpec) -> bool:
        return True

    def _add_cell(
        self,
        cost: PricingContext,
        t: TableSpec,
        load: RankLoad,
        to_all: np.ndarray,
        grads_in: np.ndarray,
        ids: float,
        mass: float,
        width: int,
        k: int,
        fwd: str,
        bwd: str,
    ) -> None:
        """The cell looks up every rank's distinct IDs of its row slice and sends each one vector per ID."""
        w, feats = cost.topology.world_size, len(t.feature_names)
        lookup_factor = WEIGHT_BYTES * (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
        load.lookup_bytes[k] += w * feats * ids * width * lookup_factor
        load.lookup_ids[k] += w * feats * ids
        to_all[k] += feats * ids * vector_bytes(width, fwd)
        grads_in[k] += feats * ids * vector_bytes(width, bwd)

    def _placement_count_bytes(self, local_batch: int) -> int:
        return 0

    def _looked_up_ids(self, cost: PricingContext, name: str, row_bounds: Sequence[int], ids: np.ndarray) -> np.ndarray:
        return cost.topology.world_size * ids


_KINDS: dict[str, ClusterKind] = {}


def register_cluster_kind(kind: ClusterKind) -> ClusterKind:
    """Adds a kind under its name. A name is what plan files and sharding-type strings ("embark_<name>") carry, so
    it is refused if taken, empty, or holding '_', ':' or '@' (which separate a sharding type's parts; every TorchRec
    type's name holds a '_', so no kind's name is one, groups.ShardingGroup)."""
    if not kind.name or any(c in kind.name for c in "_:@"):
        raise ValueError(f"cluster kind name {kind.name!r}: expected a non-empty name without '_', ':' or '@'")
    if kind.name in _KINDS:
        raise ValueError(f"cluster kind {kind.name!r} is already registered ({_KINDS[kind.name]!r})")
    _KINDS[kind.name] = kind
    return kind


def unregister_cluster_kind(name: str) -> None:
    """Removes a kind that register_cluster_kind added (a plugin's or a test's, for a while)."""
    del _KINDS[name]


def cluster_kind(name: str) -> ClusterKind:
    """The kind registered under `name`; KeyError naming the known ones otherwise."""
    try:
        return _KINDS[name]
    except KeyError:
        raise KeyError(f"unknown cluster kind {name!r}; known: {cluster_kind_names()}") from None


def cluster_kind_names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order (the built-in ones first)."""
    return tuple(_KINDS)


def cluster_kinds(names: Iterable[str]) -> list[ClusterKind]:
    return [cluster_kind(n) for n in names]


DATA_PARALLEL_KIND = register_cluster_kind(DataParallelKind())
REDUCTION_KIND = register_cluster_kind(ReductionKind())
UNIQUE_KIND = register_cluster_kind(UniqueKind())
