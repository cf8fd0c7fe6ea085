"""Model specs and hardware the planning suites share: the memory cap a search test sets, the tables of the size
classes a search must handle, and a spec file's document. Pure: no torch."""

from __future__ import annotations

from typing import Any

from embark_torchrec.plan.model.spec import TableSpec
from embark_torchrec.plan.model.topology import PRESETS, Hardware

H100 = PRESETS["dgx-h100"]

# the search suites' mixed models draw on these
HUGE = TableSpec("huge", 2_000_000, 64, 4.0)  # more than a rank holds under a small memory cap: cut
WIDE = TableSpec("wide", 200_000, 256, 1.0)  # wide rows: a column cut's case
MID = TableSpec("mid", 50_000, 32, 10.0, feature_names=("m1", "m2"))  # read by two features
HOT = TableSpec("hot", 10_000, 128, 50.0)  # the most IDs per sample
TINY = TableSpec("tiny", 10, 16, 1.0)  # a replica costs nothing


def with_memory(hbm_gb: float, base: Hardware = H100) -> Hardware:
    """`base` with hbm_gb of memory per rank and none reserved: the cap the test sets is the one the search meets."""
    return base.with_overrides(hbm_gb=hbm_gb, hbm_reserve_gb=0.0)


def spec_document() -> dict[str, Any]:
    """A model spec file's content, new on each call for a test to break: two tables, one read by two features."""
    return {
        "name": "toy",
        "batch_size": 4096,
        "id_distribution": {"kind": "zipf", "alpha": 1.05},
        "tables": [
            {"name": "small", "rows": 100, "dim": 16, "pooling": 1},
            {"name": "big", "rows": 1_000_000, "dim": 64, "pooling": 2.5, "feature_names": ["f_big", "g_big"]},
        ],
    }
