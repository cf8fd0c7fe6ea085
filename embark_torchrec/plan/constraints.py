"""Per-table constraints the search honours, and their translation from torchrec's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .layout import CLUSTERS, TableLayout, WirePrecision


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
        if self.cluster is not None and self.cluster not in CLUSTERS:
            raise ValueError(f"cluster {self.cluster!r} is not one of {CLUSTERS}")
        if self.ranks is not None and not self.ranks:
            raise ValueError("allowed ranks must not be empty")


def from_torchrec(constraints: Mapping[str, Any] | None) -> dict[str, TableConstraints]:
    """torchrec ParameterConstraints -> ours, by their sharding_types: ["data_parallel"] forces DP;
    a list without data_parallel forbids replication and de-duplication (TorchRec's types are all
    reduction-based), so the table goes to the RB cluster; row-wise, table-row-wise and grid allow
    row cuts, column-wise, table-column-wise and grid column cuts, table-wise neither (one cell on
    any rank). Unknown type names are refused, naming the table."""
    out: dict[str, TableConstraints] = {}
    for name, c in (constraints or {}).items():
        if isinstance(c, TableConstraints):
            out[name] = c
            continue
        types = list(getattr(c, "sharding_types", None) or [])
        unknown = sorted(set(types) - set(TORCHREC_SHARDING_TYPES))
        if unknown:
            raise ValueError(
                f"table {name!r}: unknown sharding types {unknown} in its ParameterConstraints; "
                f"known: {list(TORCHREC_SHARDING_TYPES)}"
            )
        if not types:
            continue
        if types == ["data_parallel"]:
            out[name] = TableConstraints(cluster="dp")
            continue
        out[name] = TableConstraints(
            cluster=None if "data_parallel" in types else "rb",
            row_cuts=bool(_ROW_CUTS & set(types)),
            column_cuts=bool(_COLUMN_CUTS & set(types)),
            unique_based=False,
        )
    return out
