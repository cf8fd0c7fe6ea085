"""Per-table constraints the search honours, and their translation from torchrec's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..model.fields import FieldError, boolean, choice, integer, integers, reading, shown, texts
from .kinds import DATA_PARALLEL_KIND, REDUCTION_KIND, cluster_kind_names
from .tables import TableLayout, WirePrecision
from ..model.spec import SpecError


# TorchRec's sharding types, as the cuts they allow a table (its ParameterConstraints.sharding_types)
_ROW_CUTS = {"row_wise", "table_row_wise", "grid_shard"}
_COLUMN_CUTS = {"column_wise", "table_column_wise", "grid_shard"}
TORCHREC_SHARDING_TYPES = ("data_parallel", "table_wise", *sorted(_ROW_CUTS | _COLUMN_CUTS))
# the compute kernels our plans run: fused TBEs for model-parallel tables, dense for data-parallel ones
PLANNED_KERNELS = {"fused": "model-parallel", "dense": "data-parallel"}
MIN_COLUMN_WIDTH = 4  # fbgemm's TBE needs widths in multiples of 4


@dataclass(frozen=True)
class TableConstraints:
    """cluster: force dp/rb/ub; layout: use exactly this layout; ranks: the only ranks allowed;
    row_cuts / column_cuts: whether the search may split the table's rows / columns; grid_cuts:
    whether it may split both (a row x column grid; not for optimizers with per-row state);
    min_cuts: the fewest (row, column) slices the table takes (TorchRec's sharding_types without
    table_wise ask for cuts); min_column_width: the narrowest column slice (TorchRec's
    min_partition); unique_based: whether the table may go to the UB cluster when its cluster is
    not forced."""

    cluster: str | None = None
    layout: TableLayout | None = None
    ranks: tuple[int, ...] | None = None
    precision: WirePrecision | None = None
    row_cuts: bool = True
    column_cuts: bool = True
    grid_cuts: bool = True
    min_cuts: tuple[int, int] = (1, 1)
    min_column_width: int = MIN_COLUMN_WIDTH
    unique_based: bool = True

    def __post_init__(self) -> None:
        with reading(SpecError):
            if self.cluster is not None:
                choice(self.cluster, "cluster", cluster_kind_names())
            for name, kind in (("layout", TableLayout), ("precision", WirePrecision)):
                value = getattr(self, name)
                if value is not None and not isinstance(value, kind):
                    raise FieldError(f"expected a {kind.__name__}, got {shown(value)}", name)
            if self.ranks is not None:
                object.__setattr__(self, "ranks", integers(self.ranks, "ranks"))
            for name in ("row_cuts", "column_cuts", "grid_cuts", "unique_based"):
                boolean(getattr(self, name), name)
            object.__setattr__(self, "min_cuts", integers(self.min_cuts, "min_cuts", length=2, minimum=1))
            object.__setattr__(
                self, "min_column_width", integer(self.min_column_width, "min_column_width", minimum=MIN_COLUMN_WIDTH)
            )


def from_torchrec(constraints: Mapping[str, Any] | None) -> dict[str, TableConstraints]:
    """torchrec ParameterConstraints -> ours, by their sharding_types: ["data_parallel"] forces DP;
    a list without data_parallel forbids replication and de-duplication (TorchRec's types are all
    reduction-based), so the table goes to the RB cluster; row-wise, table-row-wise and grid allow
    row cuts, column-wise, table-column-wise and grid column cuts, only grid both at once,
    table-wise neither (one cell on any rank); a list without table_wise (or data_parallel) asks
    for cuts: rows when a row type is listed, else columns, both for grid alone. min_partition is
    the narrowest column slice; compute_kernels must list one our plans run: fused, or dense, which
    in TorchRec runs data-parallel tables only, so that dense alone replicates the table (TorchRec's
    train_dlrm_data_parallel.py says "replicate" so). sharding_types that is not a list of strings,
    unknown type names, kernels we cannot run and a plain dict in place of a ParameterConstraints
    (whose fields TorchRec's planner would not read either) are SpecErrors naming the table."""
    out: dict[str, TableConstraints] = {}
    for name, c in (constraints or {}).items():
        if isinstance(c, TableConstraints):
            out[name] = c
            continue
        with reading(SpecError, where=f"table {name!r}"):
            if isinstance(c, Mapping):
                raise FieldError(
                    f"expected a TorchRec ParameterConstraints or an embark TableConstraints, got a plain "
                    f"{type(c).__name__} {shown(c)}: write ParameterConstraints(**...) (TorchRec's planner reads "
                    "its constraints' attributes, which a dict does not have)"
                )
            raw = getattr(c, "sharding_types", None)
            types = list(texts(raw, "sharding_types", allow_empty=True)) if raw is not None else []
            unknown = sorted(set(types) - set(TORCHREC_SHARDING_TYPES))
            if unknown:
                known = list(TORCHREC_SHARDING_TYPES)
                raise FieldError(f"unknown sharding types {unknown} in its ParameterConstraints; known: {known}")
            kernels = getattr(c, "compute_kernels", None)
            kernels = list(texts(kernels, "compute_kernels")) if kernels is not None else []
            replicable = not types or "data_parallel" in types
            runnable = [k for k in kernels if k in PLANNED_KERNELS and (k != "dense" or replicable)]
            if kernels and not runnable and "dense" in kernels:
                raise FieldError(
                    f"compute_kernels {kernels}: the dense kernel runs data-parallel tables only (as in TorchRec), "
                    f"which its sharding_types {types} leave out; add 'data_parallel' to them to replicate the "
                    "table, or list 'fused' to shard it",
                    "compute_kernels",
                )
            if kernels and not runnable:
                raise FieldError(
                    f"compute_kernels {kernels} lists none the embark plans run ({PLANNED_KERNELS}); "
                    "add 'fused' (or use TorchRec's planner for these kernels)",
                    "compute_kernels",
                )
            raw_width = getattr(c, "min_partition", None)
            width = integer(raw_width, "min_partition", minimum=1) if raw_width is not None else MIN_COLUMN_WIDTH
        only_dense = bool(kernels) and set(runnable) == {"dense"}
        if set(types) == {"data_parallel"} or only_dense:
            out[name] = TableConstraints(cluster=DATA_PARALLEL_KIND.name)
            continue
        if not types:
            if raw_width is not None:
                out[name] = TableConstraints(min_column_width=max(width, MIN_COLUMN_WIDTH))
            continue
        kinds = set(types)
        whole = bool(kinds & {"table_wise", "data_parallel"})
        rows, cols = bool(_ROW_CUTS & kinds), bool(_COLUMN_CUTS & kinds)
        if whole:
            least = (1, 1)
        elif kinds == {"grid_shard"}:
            least = (2, 2)
        else:
            least = (2, 1) if rows else (1, 2)
        out[name] = TableConstraints(
            cluster=None if "data_parallel" in types else REDUCTION_KIND.name,
            row_cuts=rows,
            column_cuts=cols,
            grid_cuts="grid_shard" in kinds,
            min_cuts=least,
            min_column_width=max(width, MIN_COLUMN_WIDTH),
            unique_based=False,
        )
    return out
