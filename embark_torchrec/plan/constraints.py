"""Per-table constraints the search honours, and their translation from torchrec's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .fields import FieldError, boolean, choice, integers, reading, shown, texts
from .layout import CLUSTERS, TableLayout, WirePrecision
from .spec import SpecError


# TorchRec's sharding types, as the cuts they allow a table (its ParameterConstraints.sharding_types)
_ROW_CUTS = {"row_wise", "table_row_wise", "grid_shard"}
_COLUMN_CUTS = {"column_wise", "table_column_wise", "grid_shard"}
TORCHREC_SHARDING_TYPES = ("data_parallel", "table_wise", *sorted(_ROW_CUTS | _COLUMN_CUTS))


@dataclass(frozen=True)
class TableConstraints:
    """cluster: force dp/rb/ub; layout: use exactly this layout; ranks: the only ranks allowed;
    row_cuts / column_cuts: whether the search may split the table's rows / columns; grid_cuts:
    whether it may split both (a row x column grid; not for optimizers with per-row state);
    unique_based: whether the table may go to the UB cluster when its cluster is not forced."""

    cluster: str | None = None
    layout: TableLayout | None = None
    ranks: tuple[int, ...] | None = None
    precision: WirePrecision | None = None
    row_cuts: bool = True
    column_cuts: bool = True
    grid_cuts: bool = True
    unique_based: bool = True

    def __post_init__(self) -> None:
        with reading(SpecError):
            if self.cluster is not None:
                choice(self.cluster, "cluster", CLUSTERS)
            for name, kind in (("layout", TableLayout), ("precision", WirePrecision)):
                value = getattr(self, name)
                if value is not None and not isinstance(value, kind):
                    raise FieldError(f"expected a {kind.__name__}, got {shown(value)}", name)
            if self.ranks is not None:
                object.__setattr__(self, "ranks", integers(self.ranks, "ranks"))
            for name in ("row_cuts", "column_cuts", "grid_cuts", "unique_based"):
                boolean(getattr(self, name), name)


def from_torchrec(constraints: Mapping[str, Any] | None) -> dict[str, TableConstraints]:
    """torchrec ParameterConstraints -> ours, by their sharding_types: ["data_parallel"] forces DP;
    a list without data_parallel forbids replication and de-duplication (TorchRec's types are all
    reduction-based), so the table goes to the RB cluster; row-wise, table-row-wise and grid allow
    row cuts, column-wise, table-column-wise and grid column cuts, table-wise neither (one cell on
    any rank). sharding_types that is not a list of strings, and unknown type names, are SpecErrors
    naming the table."""
    out: dict[str, TableConstraints] = {}
    for name, c in (constraints or {}).items():
        if isinstance(c, TableConstraints):
            out[name] = c
            continue
        with reading(SpecError, where=f"table {name!r}"):
            raw = getattr(c, "sharding_types", None)
            types = list(texts(raw, "sharding_types", allow_empty=True)) if raw is not None else []
            unknown = sorted(set(types) - set(TORCHREC_SHARDING_TYPES))
            if unknown:
                known = list(TORCHREC_SHARDING_TYPES)
                raise FieldError(f"unknown sharding types {unknown} in its ParameterConstraints; known: {known}")
        if not types:
            continue
        if set(types) == {"data_parallel"}:
            out[name] = TableConstraints(cluster="dp")
            continue
        out[name] = TableConstraints(
            cluster=None if "data_parallel" in types else "rb",
            row_cuts=bool(_ROW_CUTS & set(types)),
            column_cuts=bool(_COLUMN_CUTS & set(types)),
            unique_based=False,
        )
    return out
