"""Toy models the sharding suites train sharded and unsharded, and the check that they trained alike.

The layouts here are the cells several suites place the same way at each world size (2, 3, and 4 as 2 nodes x 2):
a 2x2 grid, its hierarchical twin, a unique-based cluster and TorchRec's row-wise blocks. A suite's model is a
mapping of table name to Table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.testing.training import compare_sharded_training

Config = TypeVar("Config", bound=BaseEmbeddingConfig)


class Table(NamedTuple):
    """A table of a toy model: its size, the features that read it, and its layout at each world size."""

    rows: int
    dim: int
    features: list[str]
    layouts: dict[int, TableLayout]


def ceil_rows(rows: int, parts: int) -> tuple[int, ...]:
    """TorchRec's row-wise bounds: blocks of ceil(rows / parts) rows, the last ones shorter or empty."""
    block = -(-rows // parts)
    return tuple(min(i * block, rows) for i in range(parts + 1))


def grid(ws: int, columns: tuple[int, ...] = (0, 8, 16)) -> TableLayout:
    """A 2x2 grid of 40 rows cut unevenly (13 / 27); at 4 ranks (2 nodes x 2) one row slice on each node."""
    cells = {2: ((0, 1), (1, 0)), 3: ((0, 1), (2, 0)), 4: ((0, 1), (3, 2))}[ws]
    return TableLayout("rb", (0, 13, 40), columns, cells)


def hierarchical_grid(ws: int, dim: int = 8) -> TableLayout:
    """A 2x2 grid of 36 rows (20 / 16) and columns of 4 and dim - 4, reduced hierarchically."""
    cells = {2: ((1, 0), (0, 1)), 3: ((1, 2), (0, 1)), 4: ((1, 2), (3, 0))}[ws]
    return TableLayout("rb", (0, 20, 36), (0, 4, dim), cells, hierarchical=True)


def unique(ws: int) -> TableLayout:
    """A 2x2 unique-based cluster of 24 rows x 8 columns."""
    cells = {2: ((1, 0), (0, 1)), 4: ((3, 0), (0, 2))}[ws]
    return TableLayout("ub", (0, 12, 24), (0, 4, 8), cells)


def row_wise(rows: int, dim: int, ws: int) -> TableLayout:
    """TorchRec's row-wise: one ceil block of rows on every rank."""
    return TableLayout("rb", ceil_rows(rows, ws), (0, dim), tuple((k,) for k in range(ws)))


def equal_tables(config: type[Config], n: int, rows: int, dim: int) -> list[Config]:
    """n tables t0, t1, ... of rows x dim, table t<i> read by feature f<i> alone."""
    return [config(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"]) for i in range(n)]


def ebc_tables(
    tables: Mapping[str, Table], ws: int, pooling: str
) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    """The collection's configs and their layouts at world size ws; under "mean" every table pools by MEAN."""
    configs = [
        EmbeddingBagConfig(
            name=name,
            num_embeddings=table.rows,
            embedding_dim=table.dim,
            feature_names=list(table.features),
            pooling=PoolingType.MEAN if pooling == "mean" else PoolingType.SUM,
        )
        for name, table in tables.items()
    ]
    return configs, {name: table.layouts[ws] for name, table in tables.items()}


def train_each_pooling(
    tables: Mapping[str, Table],
    configs: Sequence[tuple[str, str]],
    lws: int,
    steps: int,
    seed: int,
    **kwargs: Any,
) -> dict[str, dict[str, float]]:
    """In each rank: compare_sharded_training's differences per (pooling, optimizer) of `configs`, keyed by the
    pooling ("sum", "mean", or "weighted": SUM over weighted features)."""
    ws = dist.get_world_size()
    out = {}
    for pooling, optimizer in configs:
        ebc, layouts = ebc_tables(tables, ws, pooling)
        weighted = pooling == "weighted"
        out[pooling] = compare_sharded_training(
            ebc, layouts, lws, steps=steps, optimizer=optimizer, weighted=weighted, seed=seed, **kwargs
        )
    return out


def assert_trained_like_unsharded(
    per_rank: Sequence[Mapping[str, float]], tables: list[EmbeddingBagConfig], steps: int, atol: float, case: Any
) -> None:
    """Every rank compared each step's output under each of TorchRec's embedding names (feature@table for a shared
    feature) and each table's weight after the steps, and every difference is within atol."""
    names = [name for per_table in get_embedding_names_by_table(tables) for name in per_table]
    expected = {f"step{s}/{name}" for s in range(steps) for name in names} | {
        f"weight/ebc.embedding_bags.{t.name}.weight" for t in tables
    }
    for rank, diffs in enumerate(per_rank):
        assert set(diffs) == expected, (case, rank, sorted(set(diffs) ^ expected))
        worst = {k: v for k, v in diffs.items() if not v <= atol}
        assert not worst, (case, rank, worst)
