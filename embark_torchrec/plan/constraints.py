"""Per-table constraints the search honours, and their translation from torchrec's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .layout import CLUSTERS, TableLayout, WirePrecision


@dataclass(frozen=True)
class TableConstraints:
    """cluster: force dp/rb/ub; layout: use exactly this layout; ranks: the only ranks allowed."""

    cluster: str | None = None
    layout: TableLayout | None = None
    ranks: tuple[int, ...] | None = None
    precision: WirePrecision | None = None

    def __post_init__(self) -> None:
        if self.cluster is not None and self.cluster not in CLUSTERS:
            raise ValueError(f"cluster {self.cluster!r} is not one of {CLUSTERS}")
        if self.ranks is not None and not self.ranks:
            raise ValueError("allowed ranks must not be empty")


def from_torchrec(constraints: Mapping[str, Any] | None) -> dict[str, TableConstraints]:
    """torchrec ParameterConstraints -> ours: sharding_types == ["data_parallel"] forces DP; a
    list without data_parallel forbids replication, so the table goes to the RB cluster."""
    out: dict[str, TableConstraints] = {}
    for name, c in (constraints or {}).items():
        if isinstance(c, TableConstraints):
            out[name] = c
            continue
        types = list(getattr(c, "sharding_types", None) or [])
        if types == ["data_parallel"]:
            out[name] = TableConstraints(cluster="dp")
        elif types and "data_parallel" not in types:
            out[name] = TableConstraints(cluster="rb")
    return out
