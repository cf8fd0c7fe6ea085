"""Table layouts (EMBark's 3D sharding) and the plan file.

A TableLayout cuts a table into a grid of row slices x column slices and puts each cell on a rank;
table-wise, row-wise, column-wise, table-row-wise and grid sharding are all special cases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from .kinds import DATA_PARALLEL_KIND, REDUCTION_KIND, ClusterKind, cluster_kind, cluster_kind_names
from ..model.fields import (
    POOLED,
    SEQUENCE,
    FieldError,
    boolean,
    choice,
    integer,
    integers,
    items,
    keys,
    mapping,
    read_document,
    reading,
    table_kind,
    table_name,
)
from .torchrec_types import SEQUENCE_BUILTIN_TYPES
from .wire import ROW_SCALED_PRECISIONS

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")
ALLREDUCE_PRECISIONS = ("fp32", "fp16", "bf16")  # what TorchRec's DefaultDataParallelWrapper runs DDP's all-reduce at
PLAN_FORMAT = "embark-plan"
PLAN_VERSION = 1
_REQUIRED_PLAN_KEYS = ("format", "version", "world_size", "local_world_size", "tables")
_PLAN_KEYS = (*_REQUIRED_PLAN_KEYS, "allreduce_precision")
_LAYOUT_KEYS = ("cluster", "kind", "precision", "shards", "hierarchical", "torchrec_at_fp8")
TORCHREC_AT_FP8_RULE = (
    "torchrec_at_fp8 applies only to a table-wise or column-wise layout (column slices of one width) with fp8 "
    "in a direction of its precision"
)
TORCHREC_AT_FP8_SEQUENCE_RULE = "a sequence table's layout on TorchRec's sharding at fp8 must be table-wise"
_PRECISION_KEYS = ("forward", "backward")
_SHARD_KEYS = ("rows", "cols", "rank")


class PlanError(FieldError):
    """A plan that breaks an invariant; the message names the file, the table and the field (and the
    rank, where one is at fault)."""


@dataclass(frozen=True)
class Shard:
    rows: tuple[int, int]  # half-open
    cols: tuple[int, int]  # half-open
    rank: int


@dataclass(frozen=True)
class WirePrecision:
    """Precision of the embeddings sent forward and of the gradients sent backward."""

    forward: str = "fp32"
    backward: str = "fp32"

    def __post_init__(self) -> None:
        with reading(PlanError):
            choice(self.forward, "forward", PRECISIONS)
            choice(self.backward, "backward", PRECISIONS)

    @property
    def row_scaled(self) -> bool:
        """Whether either direction scales each row (fp8), so a dist of it must know every row's width (wire.py)."""
        return bool({self.forward, self.backward} & ROW_SCALED_PRECISIONS)


@dataclass(frozen=True)
class TableLayout:
    """cluster + a grid: ranks[r][c] holds rows [row_bounds[r], row_bounds[r+1]) x cols likewise.

    DP tables have no grid (replicated on every rank). `hierarchical` says that partial sums of
    row slices are reduced inside each node before they cross nodes. `torchrec_at_fp8`: a table-wise or
    column-wise layout (column slices of one width) at a row-scaled precision (fp8) runs on TorchRec's own
    sharding, in a group of its row width (groups.sharding_group), not on ours; the planner sets it while the step
    stays within SearchConfig.torchrec_fp8_tolerance (torchrec_fp8.py), as each width's group adds collectives and
    TorchRec sends int64 IDs.
    """

    cluster: str
    row_bounds: tuple[int, ...] = ()
    col_bounds: tuple[int, ...] = ()
    ranks: tuple[tuple[int, ...], ...] = ()
    precision: WirePrecision = field(default_factory=WirePrecision)
    hierarchical: bool = False
    torchrec_at_fp8: bool = False

    @classmethod
    def data_parallel(cls, precision: WirePrecision | None = None) -> "TableLayout":
        return cls(DATA_PARALLEL_KIND.name, precision=precision or WirePrecision())

    @classmethod
    def table_wise(cls, rows: int, dim: int, rank: int, cluster: str = REDUCTION_KIND.name) -> "TableLayout":
        return cls(cluster, (0, rows), (0, dim), ((rank,),))

    @property
    def kind(self) -> ClusterKind:
        """The registered cluster kind this layout's cluster names (kinds.py)."""
        return cluster_kind(self.cluster)

    @property
    def num_row_slices(self) -> int:
        return len(self.row_bounds) - 1

    @property
    def num_col_slices(self) -> int:
        return len(self.col_bounds) - 1

    def shards(self) -> Iterator[Shard]:
        """Row-major: every column slice of row slice 0, then row slice 1, ..."""
        for r in range(self.num_row_slices):
            for c in range(self.num_col_slices):
                yield Shard(
                    (self.row_bounds[r], self.row_bounds[r + 1]),
                    (self.col_bounds[c], self.col_bounds[c + 1]),
                    self.ranks[r][c],
                )

    def used_ranks(self) -> set[int]:
        return {k for row in self.ranks for k in row}

    def __hash__(self) -> int:  # layouts key the cost model's caches; hash the grid once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(
                (
                    self.cluster,
                    self.row_bounds,
                    self.col_bounds,
                    self.ranks,
                    self.precision,
                    self.hierarchical,
                    self.torchrec_at_fp8,
                )
            )
            object.__setattr__(self, "_hash", cached)
        return cached

    def with_ranks(self, ranks: tuple[tuple[int, ...], ...]) -> "TableLayout":
        return TableLayout(
            self.cluster,
            self.row_bounds,
            self.col_bounds,
            ranks,
            self.precision,
            self.hierarchical,
            self.torchrec_at_fp8,
        )

    def fp8_builtin_type(self, sequence: bool = False) -> str | None:
        """The TorchRec sharding type that may run this layout (of a sequence table's, for `sequence`) at its
        row-scaled precision, one group per row width (what `torchrec_at_fp8` may choose), or None: none, or the
        precision is element-wise (fp32 / fp16 / bf16), where a layout TorchRec runs always runs on TorchRec's
        sharding."""
        if not self.precision.row_scaled:
            return None
        builtin = self.kind.fp8_builtin_type(self)
        return None if sequence and builtin not in SEQUENCE_BUILTIN_TYPES else builtin

    def torchrec_at_fp8_refusal(self, sequence: bool = False) -> str | None:
        """Why this layout (of a sequence table's, for `sequence`) may not set `torchrec_at_fp8`, or None."""
        if not self.torchrec_at_fp8 or self.fp8_builtin_type(sequence) is not None:
            return None
        return TORCHREC_AT_FP8_SEQUENCE_RULE if self.fp8_builtin_type() is not None else TORCHREC_AT_FP8_RULE

    def split_rows(self, r: int, at: int, new_ranks: tuple[int, ...]) -> "TableLayout":
        """Cut row slice r at row `at`; the lower part keeps its ranks, the upper goes to new_ranks."""
        bounds = self.row_bounds[: r + 1] + (at,) + self.row_bounds[r + 1 :]
        ranks = self.ranks[: r + 1] + (new_ranks,) + self.ranks[r + 1 :]
        return replace(self, row_bounds=bounds, ranks=ranks, torchrec_at_fp8=False)

    def split_cols(self, c: int, at: int, new_ranks: tuple[int, ...]) -> "TableLayout":
        """Cut column slice c at column `at`; the right part goes to new_ranks (one per row slice)."""
        bounds = self.col_bounds[: c + 1] + (at,) + self.col_bounds[c + 1 :]
        ranks = tuple(row[: c + 1] + (new_ranks[r],) + row[c + 1 :] for r, row in enumerate(self.ranks))
        return replace(self, col_bounds=bounds, ranks=ranks, torchrec_at_fp8=False)

    def validate(self, table: str, rows: int, dim: int, world_size: int) -> None:
        """Exact tiling of rows x dim, column cuts on multiples of 4, ranks in range."""
        where = f"table {table!r}"
        if self.cluster not in cluster_kind_names():
            raise PlanError(f"{where}: cluster {self.cluster!r} is not one of {cluster_kind_names()}")
        if self.kind.replicated:
            if self.row_bounds or self.col_bounds or self.ranks:
                raise PlanError(f"{where}: a {self.cluster} table is replicated and has no shards")
            return
        for name, bounds, size in (("row", self.row_bounds, rows), ("column", self.col_bounds, dim)):
            if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != size:
                raise PlanError(f"{where}: {name} bounds {list(bounds)} do not cover [0, {size})")
            if any(b >= a for a, b in zip(bounds[1:], bounds)):
                raise PlanError(f"{where}: {name} bounds {list(bounds)} are not strictly increasing")
        if any(b % 4 for b in self.col_bounds):
            raise PlanError(f"{where}: column bounds {list(self.col_bounds)} are not multiples of 4")
        if len(self.ranks) != self.num_row_slices or any(len(r) != self.num_col_slices for r in self.ranks):
            raise PlanError(f"{where}: ranks grid does not match {self.num_row_slices} x {self.num_col_slices} slices")
        for k in self.used_ranks():
            if not 0 <= k < world_size:
                raise PlanError(f"{where}: rank {k} is outside world size {world_size}")
        refusal = self.torchrec_at_fp8_refusal()
        if refusal is not None:
            raise PlanError(f"{where}: {refusal}")
        mixed = self.mixed_width_rank()
        if mixed is not None:
            raise PlanError(
                f"{where}: rank {mixed} holds cells of different widths; "
                "TorchRec 1.8 assumes one width per table on a rank"
            )

    def mixed_width_rank(self) -> int | None:
        """A rank holding cells of this table with different widths, if any."""
        width_on: dict[int, int] = {}
        for c in range(self.num_col_slices):
            w = self.col_bounds[c + 1] - self.col_bounds[c]
            for r in range(self.num_row_slices):
                k = self.ranks[r][c]
                if width_on.setdefault(k, w) != w:
                    return k
        return None


@dataclass(frozen=True)
class Plan:
    """{table: TableLayout} for a world of world_size ranks in nodes of local_world_size; `kinds`:
    the table kind (spec.py) of the tables it was planned for, where recorded (with_kinds): plan
    files say which tables are sequence tables, and a table left out is pooled. `allreduce_precision`: the
    precision of DDP's gradient all-reduce, which carries the dense part's gradients and the data-parallel
    tables' together across every rank (TorchRec's DefaultDataParallelWrapper(allreduce_comm_precision=);
    sharding.data_parallel.data_parallel_wrapper gives DMP that wrapper)."""

    world_size: int
    local_world_size: int
    tables: Mapping[str, TableLayout]
    kinds: Mapping[str, str] = field(default_factory=dict)
    allreduce_precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.allreduce_precision not in ALLREDUCE_PRECISIONS:
            raise PlanError(
                f"allreduce_precision: expected one of {list(ALLREDUCE_PRECISIONS)} (DDP's all-reduce), "
                f"got {self.allreduce_precision!r}"
            )

    def __getitem__(self, table: str) -> TableLayout:
        return self.tables[table]

    def replace_table(self, table: str, layout: TableLayout) -> "Plan":
        return replace(self, tables={**self.tables, table: layout})

    def with_kinds(self, spec: Any) -> "Plan":
        """This plan recording the kind of each of `spec`'s tables that is not pooled."""
        return replace(self, kinds={t.name: t.kind for t in spec.tables if t.kind != POOLED})

    def validate(self, spec: Any, memory_per_rank: Any = None, cap_bytes: float | None = None) -> None:
        """Every table of `spec` laid out exactly once and tiled exactly; memory within the cap.

        `memory_per_rank` is the cost model's per-rank bytes (weights + optimizer state).
        """
        names = {t.name for t in spec.tables}
        missing = sorted(names - set(self.tables))
        extra = sorted(set(self.tables) - names)
        if missing:
            raise PlanError(f"plan has no layout for tables {missing}")
        if extra:
            raise PlanError(f"plan lays out tables {extra} that the model does not have")
        for t in spec.tables:
            recorded = self.kinds.get(t.name, t.kind)
            if recorded != t.kind:
                raise PlanError(f"table {t.name!r}: the plan is for a {recorded} table, the model's is {t.kind}")
            layout = self.tables[t.name]
            layout.validate(t.name, t.rows, t.dim, self.world_size)
            refusal = layout.torchrec_at_fp8_refusal(t.is_sequence)
            if refusal is not None:
                raise PlanError(f"table {t.name!r}: field 'torchrec_at_fp8': {refusal}")
        if memory_per_rank is not None and cap_bytes is not None:
            for rank, used in enumerate(memory_per_rank):
                if used > cap_bytes:
                    raise PlanError(
                        f"rank {rank} needs {used / 1e9:.2f} GB of embedding memory, "
                        f"over its cap of {cap_bytes / 1e9:.2f} GB"
                    )

    def check_replicated_precision(self) -> None:
        """Refuses, by table and field, a data-parallel table's precision that would not run as written: its
        gradients travel in DDP's all-reduce with the dense part, at the plan's allreduce_precision alone (fp8 is
        none DDP runs), and it sends no embeddings forward (each rank looks up its own batch), so its forward is
        fp32. A plan file's other precision was trained at the plan's without a word."""
        for name, layout in self.tables.items():
            if not layout.kind.replicated:
                continue
            where = f"table {name!r}"
            if layout.precision.backward != self.allreduce_precision:
                raise PlanError(
                    f"data-parallel gradients at {layout.precision.backward}, but DDP all-reduces every data-parallel "
                    f"table and the dense part at the plan's allreduce_precision {self.allreduce_precision} (one of "
                    f"{list(ALLREDUCE_PRECISIONS)})",
                    "precision.backward",
                    where,
                )
            if layout.precision.forward != "fp32":
                raise PlanError(
                    "a data-parallel table sends no embeddings (each rank looks up its own batch), so it runs at "
                    f"fp32, not {layout.precision.forward}",
                    "precision.forward",
                    where,
                )

    def to_dict(self) -> dict[str, Any]:
        tables = {}
        for name, t in self.tables.items():
            entry: dict[str, Any] = {
                "cluster": t.cluster,
                **({"kind": self.kinds[name]} if name in self.kinds else {}),
                "precision": {"forward": t.precision.forward, "backward": t.precision.backward},
                "shards": [{"rows": list(s.rows), "cols": list(s.cols), "rank": s.rank} for s in t.shards()],
            }
            if t.hierarchical:
                entry["hierarchical"] = True
            if t.torchrec_at_fp8:
                entry["torchrec_at_fp8"] = True
            tables[name] = entry
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            **({"allreduce_precision": self.allreduce_precision} if self.allreduce_precision != "fp32" else {}),
            "tables": tables,
        }

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        """The plan file's format (docs/files.md, "Plan file"), field by field: exactly what to_dict writes,
        with `kind` (default pooled), `precision`, `hierarchical`, `torchrec_at_fp8` and a dp table's empty `shards`
        optional."""
        with reading(PlanError):
            m = mapping(d, "")
            header = (m.get("format"), m.get("version"))
            if header != (PLAN_FORMAT, PLAN_VERSION) or type(header[1]) is not int:
                raise PlanError(
                    f"not an {PLAN_FORMAT} version {PLAN_VERSION} file (format={header[0]!r}, version={header[1]!r})"
                )
            keys(m, "", _PLAN_KEYS, required=_REQUIRED_PLAN_KEYS)
            allreduce = choice(m.get("allreduce_precision", "fp32"), "allreduce_precision", ALLREDUCE_PRECISIONS)
            ws = integer(m["world_size"], "world_size", minimum=1)
            lws = integer(m["local_world_size"], "local_world_size", minimum=1)
            if ws % lws:
                raise FieldError(f"expected a divisor of world_size {ws}, got {lws}", "local_world_size")
            entries = mapping(m["tables"], "tables")
        tables, kinds = {}, {}
        for name, entry in entries.items():
            with reading(PlanError, where=f"table {name!r}"):
                table_name(name, "")
            tables[name] = _layout_from_dict(name, entry, ws)
            if "kind" in entry:  # a mapping with known keys: _layout_from_dict checked it
                with reading(PlanError, where=f"table {name!r}"):
                    kinds[name] = table_kind(entry["kind"], "kind")
        return cls(ws, lws, tables, kinds, allreduce)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """A plan file; every error names the file."""
        data = read_document(path, PlanError, allow_yaml=False)
        with reading(PlanError, file=str(path)):
            return cls.from_dict(data)


def grid_from_shards(
    where: str, shards: Sequence[Shard]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The R x C grid a shard list forms (row bounds, column bounds, the rank of each cell); refused,
    naming `where`, when the shards are not an exact grid: empty, overlapping, not one cell each, or
    leaving a gap. The one parser of shard lists: plan files and the runtime's ShardMetadata."""
    row_bounds = sorted({b for s in shards for b in s.rows})
    col_bounds = sorted({b for s in shards for b in s.cols})
    row_at = {b: i for i, b in enumerate(row_bounds)}  # a bound's index, in constant time: linear in cells overall
    col_at = {b: i for i, b in enumerate(col_bounds)}
    cell: dict[tuple[int, int], int] = {}
    for s in shards:
        (r0, r1), (c0, c1) = s.rows, s.cols
        if r0 >= r1 or c0 >= c1:
            raise PlanError(f"{where}: empty shard rows {list(s.rows)} cols {list(s.cols)}")
        for r in range(row_at[r0], row_at[r1]):
            for c in range(col_at[c0], col_at[c1]):
                if (r, c) in cell:
                    raise PlanError(
                        f"{where}: shards overlap at rows {row_bounds[r]}:{row_bounds[r + 1]} "
                        f"cols {col_bounds[c]}:{col_bounds[c + 1]}"
                    )
                cell[(r, c)] = s.rank
        if (row_at[r1] - row_at[r0]) * (col_at[c1] - col_at[c0]) != 1:
            raise PlanError(
                f"{where}: shard rows {list(s.rows)} cols {list(s.cols)} is not one cell of the table's grid"
            )
    n_r, n_c = len(row_bounds) - 1, len(col_bounds) - 1
    gaps = [(r, c) for r in range(n_r) for c in range(n_c) if (r, c) not in cell]
    if gaps:
        r, c = gaps[0]
        raise PlanError(
            f"{where}: no shard covers rows {row_bounds[r]}:{row_bounds[r + 1]} "
            f"cols {col_bounds[c]}:{col_bounds[c + 1]}"
        )
    return tuple(row_bounds), tuple(col_bounds), tuple(tuple(cell[(r, c)] for c in range(n_c)) for r in range(n_r))


def _layout_from_dict(name: str, entry: Any, world_size: int) -> TableLayout:
    """One table's entry, field by field; the grid is rebuilt from the shard list, refusing shard
    lists that are not an exact grid."""
    where = f"table {name!r}"
    with reading(PlanError, where=where):
        m = mapping(entry, "")
        keys(m, "", _LAYOUT_KEYS, required=("cluster",))
        cluster = choice(m["cluster"], "cluster", cluster_kind_names())
        with reading(PlanError, parent="precision"):
            prec = mapping(m.get("precision", {}), "")
            keys(prec, "", _PRECISION_KEYS)
            precision = WirePrecision(prec.get("forward", "fp32"), prec.get("backward", "fp32"))
        hierarchical = boolean(m.get("hierarchical", False), "hierarchical")
        torchrec_at_fp8 = boolean(m.get("torchrec_at_fp8", False), "torchrec_at_fp8")
        entries = items(m.get("shards", []), "shards", "a list of shards")
        if cluster_kind(cluster).replicated:
            if entries:
                raise FieldError(f"a {cluster} table is replicated and must have no shards", "shards")
            if hierarchical:
                raise FieldError(f"a {cluster} table is replicated and has no partial sums to reduce", "hierarchical")
            if torchrec_at_fp8:
                raise FieldError(TORCHREC_AT_FP8_RULE, "torchrec_at_fp8")
            return TableLayout(cluster, precision=precision)
        if not entries:
            raise FieldError(f"cluster {cluster!r} needs shards", "shards")
        shards = [_shard_from_dict(s, f"shards[{i}]", world_size) for i, s in enumerate(entries)]
    row_bounds, col_bounds, ranks = grid_from_shards(where, shards)
    layout = TableLayout(cluster, row_bounds, col_bounds, ranks, precision, hierarchical, torchrec_at_fp8)
    refusal = layout.torchrec_at_fp8_refusal(m.get("kind") == SEQUENCE)
    if refusal is not None:
        with reading(PlanError, where=where):
            raise FieldError(refusal, "torchrec_at_fp8")
    return layout


def _shard_from_dict(entry: Any, field: str, world_size: int) -> Shard:
    """{"rows": [start, end], "cols": [start, end], "rank": k} with 0 <= k < world_size."""
    s = mapping(entry, field)
    keys(s, field, _SHARD_KEYS, required=_SHARD_KEYS)
    rank = integer(s["rank"], f"{field}.rank")
    if rank >= world_size:
        raise FieldError(f"rank {rank} is outside world size {world_size}", f"{field}.rank")
    rows = integers(s["rows"], f"{field}.rows", length=2)
    cols = integers(s["cols"], f"{field}.cols", length=2)
    return Shard((rows[0], rows[1]), (cols[0], cols[1]), rank)
