"""The shipped benchmark models shrunk to CPU size, and a topology small enough that the planner splits them.

Why: the benchmark specs (dcnv2, t180, t200, t510) have tables of up to 500M rows and up to 510 tables, far
beyond what a few gloo ranks on a laptop can hold. ``scaled_spec`` keeps their shape (the spread of row counts,
widths and hotness) but makes every table small; ``cpu_topology`` gives each rank only a fraction of the scaled
model's memory, so the planner has to split tables across ranks as it would at full size.
"""

from __future__ import annotations

import math
from dataclasses import replace

from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology, hardware_preset

__all__ = ["cpu_topology", "ebc_tables", "scaled_spec", "spread_subset"]


def spread_subset(tables: tuple[TableSpec, ...], count: int) -> tuple[TableSpec, ...]:
    """``count`` tables evenly spaced over the tables sorted by (dim, pooling, rows, name).

    Deterministic, and it keeps the extremes (the first and last in that order) and the variety in between,
    e.g. every width class and the hot and cold ends of each.
    """
    if count >= len(tables):
        return tuple(tables)
    ordered = sorted(tables, key=lambda t: (t.dim, t.pooling, t.rows, t.name))
    picks = sorted({round(i * (len(ordered) - 1) / (count - 1)) for i in range(count)})
    return tuple(ordered[i] for i in picks)


def scaled_rows(rows: int, cap: int = 4000) -> int:
    """Tiny tables stay as they are; bigger ones shrink to about 2 x sqrt(rows), at least 64 and at most ``cap``."""
    if rows <= 64:
        return rows
    return max(64, min(cap, 2 * math.isqrt(rows)))


def scaled_dim(dim: int, divisor: int = 8) -> int:
    """dim / divisor, rounded down to a multiple of 4 (column cuts are on multiples of 4), at least 4."""
    return max(4, (dim // divisor) // 4 * 4)


def scaled_spec(
    spec: ModelSpec,
    max_tables: int | None = None,
    batch_size: int = 16,
    row_cap: int = 4000,
    dim_divisor: int = 8,
) -> ModelSpec:
    """``spec`` at CPU size: a spread subset of at most ``max_tables`` tables, scaled rows and widths, the same
    pooling factors (hotness) and ID distributions, and a global batch of ``batch_size``."""
    tables = spread_subset(spec.tables, max_tables) if max_tables else spec.tables
    small = tuple(replace(t, rows=scaled_rows(t.rows, row_cap), dim=scaled_dim(t.dim, dim_divisor)) for t in tables)
    return replace(spec, name=f"{spec.name}-cpu", batch_size=batch_size, tables=small)


def ebc_tables(spec: ModelSpec, mean_every: int = 3) -> list:
    """EmbeddingBagConfigs for ``spec``: every ``mean_every``-th table (index % mean_every == mean_every - 1) pools
    by MEAN, the rest by SUM, so both poolings appear in every sharding type the plan uses."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            feature_names=list(t.feature_names),
            pooling=PoolingType.MEAN if mean_every and i % mean_every == mean_every - 1 else PoolingType.SUM,
        )
        for i, t in enumerate(spec.tables)
    ]


def cpu_topology(
    spec: ModelSpec, world_size: int = 4, local_world_size: int = 2, memory_share: float = 0.5
) -> Topology:
    """The "cpu-gloo" preset whose per-rank embedding memory is ``memory_share`` of the model's fp32 weights plus
    row-wise Adagrad state (the cost model's default: 4 bytes per element, 4 per row), with nothing reserved; and
    GPU-like ratios instead of the measured CPU figures (lookups at 5 GB/s, node links at 2, the network at 1, no
    per-collective or per-ID overheads, a GPU per rank), so that the plans hold the layouts a GPU cluster gets: grids,
    hierarchical reductions, several sharding groups."""
    model_bytes = sum(t.rows * (t.dim * 4 + 4) for t in spec.tables)
    hardware = hardware_preset("cpu-gloo").with_overrides(
        hbm_gb=memory_share * model_bytes / 1e9,
        hbm_reserve_gb=0.0,
        hbm_bw_gbps=5.0,
        intra_node_bw_gbps=2.0,
        inter_node_bw_gbps=1.0,
        collective_us=0.0,
        lookup_ns_per_id=0.0,
        host_cores=0,
    )
    return Topology(world_size, local_world_size, hardware)
