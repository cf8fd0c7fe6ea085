"""Model specs: what the planner needs to know about each embedding table.

A spec comes from a JSON/YAML file (format in docs/files.md) or from a torchrec
EmbeddingBagCollection or EmbeddingCollection plus the pooling factors of its ParameterConstraints.

A table is "pooled" (an EmbeddingBagCollection's: one vector per bag) or "sequence" (an
EmbeddingCollection's: one vector per ID); the kind changes what its output sends (cost/model.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .fields import (
    POOLED,
    SEQUENCE,
    FieldError,
    choice,
    integer,
    items,
    keys,
    mapping,
    number,
    numbers,
    read_document,
    reading,
    require,
    shown,
    table_kind,
    table_name,
    text,
    texts,
)
from .ranges import MAX_BATCH_SIZE, MAX_DIM, MAX_POOLING, MAX_ROWS, MAX_ZIPF_ALPHA, MIN_UNIQUE_RATIO

_MODEL_KEYS = ("name", "description", "source", "batch_size", "id_distribution", "tables")
_TABLE_KEYS = ("name", "rows", "dim", "pooling", "kind", "feature_names", "id_distribution", "unique_ratio")
_DIST_KEYS = ("kind", "alpha")
_DIST_KINDS = ("zipf", "uniform")

# Below this many ranks the Zipf sums are exact; above it they use log-spaced buckets.
_EXACT_HEAD = 4096
_BUCKET_GROWTH = 1.01


class SpecError(FieldError):
    """A model spec that cannot be planned; the message names the file, the table and the field."""


@dataclass(frozen=True)
class IdDistribution:
    """How often each ID of a feature is drawn: Zipf(alpha) over the table's rows, or uniform.

    The planner assumes hot IDs sit at no particular row positions (IDs are hashed into the table,
    as is usual for TorchRec inputs), so a slice of f of the rows gets f of the lookups and f of
    the distinct IDs.
    """

    kind: str = "uniform"
    alpha: float = 0.0

    def __post_init__(self) -> None:
        with reading(SpecError):
            choice(self.kind, "kind", _DIST_KINDS)
            if self.kind == "zipf":
                object.__setattr__(self, "alpha", number(self.alpha, "alpha", at_most=MAX_ZIPF_ALPHA))
            elif self.alpha != 0 or isinstance(self.alpha, bool):
                raise FieldError("applies to kind 'zipf' only", "alpha")

    @classmethod
    def from_dict(cls, d: Any) -> "IdDistribution":
        """{"kind": "zipf", "alpha": 1.1} or {"kind": "uniform"} (the default kind)."""
        with reading(SpecError):
            m = mapping(d, "")
            keys(m, "", _DIST_KEYS, required=("alpha",) if m.get("kind") == "zipf" else ())
            return cls(kind=m.get("kind", "uniform"), alpha=m.get("alpha", 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "alpha": self.alpha} if self.kind == "zipf" else {"kind": "uniform"}

    @lru_cache(maxsize=4096)  # models repeat tables; the sum costs milliseconds
    def expected_distinct(self, rows: int, draws: float) -> float:
        """Expected number of distinct rows hit by `draws` independent draws.

        E[distinct] = sum_i 1 - (1 - p_i)^N, with p_i the probability of row i and N the number of
        draws; uniform: p_i = 1 / rows; Zipf: p_i = (i+1)^-alpha / sum_j (j+1)^-alpha. The 4096
        hottest rows are summed exactly, the tail in log-spaced buckets 1% wide, each taken at its
        middle row (well under 1% error, see tests).
        """
        if self.kind == "uniform" or rows <= 1:
            return float(rows * -np.expm1(draws * np.log1p(-1.0 / rows))) if rows > 1 else float(min(1.0, draws))
        head = np.arange(1, min(rows, _EXACT_HEAD) + 1, dtype=np.float64)
        edges = [float(len(head))]
        while edges[-1] < rows:
            edges.append(min(float(rows), math.floor(edges[-1] * _BUCKET_GROWTH) + 1.0))
        e = np.asarray(edges)
        sizes = e[1:] - e[:-1]
        mid = e[:-1] + 1.0 + (sizes - 1.0) / 2.0  # 1-based middle row of each bucket
        head_w, tail_w = head**-self.alpha, mid**-self.alpha
        norm = head_w.sum() + (tail_w * sizes).sum()
        hit = lambda w: -np.expm1(draws * np.log1p(-w / norm))  # noqa: E731
        return float(hit(head_w).sum() + (hit(tail_w) * sizes).sum())


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: size, how many IDs a sample looks up, how they repeat, and whether its
    output is one vector per bag ("pooled") or per ID ("sequence")."""

    name: str
    rows: int
    dim: int
    pooling: float
    feature_names: tuple[str, ...] = ()
    id_distribution: IdDistribution | None = None
    unique_ratio: float | None = None
    kind: str = POOLED

    def __post_init__(self) -> None:
        """Every field by type and value, within its plannable range (ranges.py: costs stay finite); files, dicts
        and TorchRec modules all come through here; feature_names () means the one feature named like the table."""
        with reading(SpecError):
            table_name(self.name, "name")
        with reading(SpecError, where=f"table {self.name!r}"):
            integer(self.rows, "rows", minimum=1, maximum=MAX_ROWS)
            if integer(self.dim, "dim", minimum=1, maximum=MAX_DIM) % 4:
                raise FieldError(f"expected a multiple of 4, got {self.dim}", "dim")
            object.__setattr__(self, "pooling", number(self.pooling, "pooling", at_most=MAX_POOLING))
            table_kind(self.kind, "kind")
            features = (self.name,) if self.feature_names == () else texts(self.feature_names, "feature_names")
            object.__setattr__(self, "feature_names", features)
            if self.id_distribution is not None and not isinstance(self.id_distribution, IdDistribution):
                raise FieldError(f"expected an IdDistribution, got {shown(self.id_distribution)}", "id_distribution")
            if self.unique_ratio is not None:
                ratio = number(self.unique_ratio, "unique_ratio", at_least=MIN_UNIQUE_RATIO, at_most=1.0)
                object.__setattr__(self, "unique_ratio", ratio)

    @property
    def is_sequence(self) -> bool:
        return self.kind == SEQUENCE

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "rows": self.rows, "dim": self.dim, "pooling": self.pooling}
        if self.kind != POOLED:
            d["kind"] = self.kind
        if self.feature_names != (self.name,):
            d["feature_names"] = list(self.feature_names)
        if self.id_distribution is not None:
            d["id_distribution"] = self.id_distribution.to_dict()
        if self.unique_ratio is not None:
            d["unique_ratio"] = self.unique_ratio
        return d


@dataclass(frozen=True)
class ModelSpec:
    """The embedding part of a model: its tables, the global batch and the default ID distribution."""

    name: str
    batch_size: int
    tables: tuple[TableSpec, ...]
    id_distribution: IdDistribution = field(default_factory=IdDistribution)

    def __post_init__(self) -> None:
        with reading(SpecError):
            text(self.name, "name")
        with reading(SpecError, where=f"model {self.name!r}"):
            integer(self.batch_size, "batch_size", minimum=1, maximum=MAX_BATCH_SIZE)
            if not isinstance(self.id_distribution, IdDistribution):
                raise FieldError(f"expected an IdDistribution, got {shown(self.id_distribution)}", "id_distribution")
            tables = tuple(items(self.tables, "tables", "a list of tables"))
            if not tables:
                raise FieldError("the model has no tables", "tables")
            object.__setattr__(self, "tables", tables)
        seen: set[str] = set()
        for t in tables:  # a feature may feed several tables, as in TorchRec (one lookup per table)
            if not isinstance(t, TableSpec):
                raise SpecError(f"expected a TableSpec, got {shown(t)}", "tables", f"model {self.name!r}")
            if t.name in seen:
                raise SpecError("another table has this name too", "name", f"table {t.name!r}")
            seen.add(t.name)

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"model {self.name!r} has no table {name!r}")

    def distribution(self, table: TableSpec) -> IdDistribution:
        return table.id_distribution or self.id_distribution

    def with_measured(self, measured: "ModelSpec") -> "ModelSpec":
        """This spec with the pooling and unique ratio of its tables that `measured` also holds (e.g.
        profile_features(...).spec); a table there with other rows or dim is refused."""
        known = {t.name: t for t in measured.tables}
        tables = []
        for t in self.tables:
            m = known.get(t.name)
            if m is not None and (m.rows, m.dim) != (t.rows, t.dim):
                raise SpecError(f"table {t.name!r}: measured spec has {m.rows} x {m.dim}, the model {t.rows} x {t.dim}")
            tables.append(t if m is None else replace(t, pooling=m.pooling, unique_ratio=m.unique_ratio))
        return replace(self, tables=tuple(tables))

    def with_batch_size(self, batch_size: int) -> "ModelSpec":
        return replace(self, batch_size=batch_size)

    def expected_unique_ratio(self, table: TableSpec, world_size: int) -> float:
        """Expected distinct / total IDs among one rank's lookups of `table`.

        One rank draws N = (batch_size / world_size) x pooling IDs; the expected distinct count is
        sum_i 1 - (1 - p_i)^N (see IdDistribution.expected_distinct). A spec's unique_ratio wins.
        """
        if table.unique_ratio is not None:
            return table.unique_ratio
        draws = self.batch_size / world_size * table.pooling
        return min(1.0, self.distribution(table).expected_distinct(table.rows, draws) / draws)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "batch_size": self.batch_size,
            "id_distribution": self.id_distribution.to_dict(),
            "tables": [t.to_dict() for t in self.tables],
        }

    @classmethod
    def from_dict(cls, d: Any) -> "ModelSpec":
        """The spec file's format (docs/files.md), field by field; `description` and
        `source` are free text for people."""
        with reading(SpecError):
            m = mapping(d, "")
            keys(m, "", _MODEL_KEYS, required=("batch_size", "tables"))
            for key in ("description", "source"):
                if key in m:
                    text(m[key], key)
            name = text(m.get("name", "model"), "name")
        with reading(SpecError, where=f"model {name!r}"):
            with reading(SpecError, parent="id_distribution"):
                dist = IdDistribution.from_dict(m.get("id_distribution", {}))
            raw_tables = items(m["tables"], "tables", "a list of tables")
        tables = tuple(_table_from_dict(t, i) for i, t in enumerate(raw_tables))
        return cls(name=name, batch_size=m["batch_size"], tables=tables, id_distribution=dist)

    @classmethod
    def from_module(
        cls,
        module: Any,
        constraints: Mapping[str, Any] | None = None,
        batch_size: int = 65536,
        name: str = "model",
        id_distribution: IdDistribution | None = None,
        rank_batch_size: int | None = None,
    ) -> "ModelSpec":
        """From a torchrec EmbeddingBagCollection (pooled tables) or EmbeddingCollection (sequence
        tables) and its ParameterConstraints (pooling_factors, num_poolings, batch_sizes: one per
        feature, as TorchRec's planner reads them; a sequence feature's pooling factor is its mean
        sequence length).

        A feature looks up pooling_factor x num_poolings IDs per sample for batch_sizes[i] samples
        per rank (default: `rank_batch_size`, the planner's); a table's pooling is the mean over its
        features of those IDs per sample of the rank's batch. Without pooling factors it is 1.0, as
        in torchrec's planner.
        """
        configs, kind = module_tables(module)
        constraints = constraints or {}
        tables = []
        for cfg in configs:
            c = constraints.get(cfg.name)
            n = len(cfg.feature_names) or 1
            with reading(SpecError, where=f"table {cfg.name!r}"):
                pf = _per_feature(c, "pooling_factors", n, 1.0)
                poolings = _per_feature(c, "num_poolings", n, 1.0)
                batches = _per_feature(c, "batch_sizes", n, float(rank_batch_size or 1))
                share = [b / rank_batch_size if rank_batch_size else 1.0 for b in batches]
                pooling = sum(p * k * r for p, k, r in zip(pf, poolings, share)) / n
                if not pooling <= MAX_POOLING:  # the table's check would name its own field, not these
                    raise FieldError(
                        f"the IDs per sample they give (pooling_factors x num_poolings x batch_sizes' share, over the "
                        f"table's features) are {pooling:g}, beyond the plannable {MAX_POOLING:g}",
                        "pooling_factors",
                    )
            tables.append(
                TableSpec(
                    name=cfg.name,
                    rows=int(cfg.num_embeddings),
                    dim=int(cfg.embedding_dim),
                    pooling=pooling,
                    feature_names=tuple(cfg.feature_names),
                    kind=kind,
                )
            )
        return cls(
            name=name, batch_size=batch_size, tables=tuple(tables), id_distribution=id_distribution or IdDistribution()
        )


def module_tables(module: Any) -> tuple[list[Any], str]:
    """The table configs of a torchrec EmbeddingBagCollection (pooled) or EmbeddingCollection
    (sequence), and that kind."""
    if hasattr(module, "embedding_bag_configs"):
        return list(module.embedding_bag_configs()), POOLED
    if hasattr(module, "embedding_configs"):
        return list(module.embedding_configs()), SEQUENCE
    raise SpecError(f"expected a TorchRec EmbeddingBagCollection or EmbeddingCollection, got {type(module).__name__}")


def _per_feature(constraint: Any, field: str, features: int, default: float) -> tuple[float, ...]:
    """A ParameterConstraints list with one value per feature (TorchRec asserts equal lengths); one
    value stands for all features; absent: `default` for each."""
    raw = getattr(constraint, field, None)
    if raw is None:
        return (default,) * features
    values = numbers(raw, field)
    if len(values) == 1:
        return values * features
    if len(values) != features:
        raise FieldError(f"expected {features} values (one per feature of the table), got {len(values)}", field)
    return values


def _table_from_dict(t: Any, index: int) -> TableSpec:
    """One entry of `tables`: named by its index until its name is known. The values are checked by
    TableSpec itself; an explicit feature_names must be a non-empty list."""
    with reading(SpecError, where=f"table #{index}"):
        m = mapping(t, "")
        name = table_name(require(m, "name"), "name")
    with reading(SpecError, where=f"table {name!r}"):
        keys(m, "", _TABLE_KEYS, required=("rows", "dim", "pooling"))
        features = texts(m["feature_names"], "feature_names") if "feature_names" in m else ()
        dist = None
        if "id_distribution" in m:
            with reading(SpecError, parent="id_distribution"):
                dist = IdDistribution.from_dict(m["id_distribution"])
        return TableSpec(
            name=name,
            rows=m["rows"],
            dim=m["dim"],
            pooling=m["pooling"],
            feature_names=features,
            id_distribution=dist,
            unique_ratio=m.get("unique_ratio"),
            kind=m.get("kind", POOLED),
        )


def load_model_spec(path: str | Path) -> ModelSpec:
    """Read a model spec from JSON, or YAML when the file ends in .yaml/.yml; every error names the file."""
    data = read_document(path, SpecError, allow_yaml=True)
    with reading(SpecError, file=str(path)):
        return ModelSpec.from_dict(data)


_BUILTIN = Path(__file__).resolve().parents[2] / "models"


def builtin_model(name: str) -> ModelSpec:
    """One of the benchmark models shipped with the package: dcnv2, t180, t200, t510."""
    path = _BUILTIN / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in _BUILTIN.glob("*.json"))
        raise SpecError(f"no built-in model {name!r}; known: {known}")
    return load_model_spec(path)
