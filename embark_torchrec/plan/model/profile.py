"""Measure pooling factors and unique ratios from real input batches, to plan on facts.

The planner's cost depends most on each table's pooling (IDs per sample per feature) and unique
ratio (distinct / total IDs in one rank's batch, per feature). Guessed values, or a Zipf model with
a guessed alpha, can be far off; `profile_features` counts them on batches as one rank sees them and
returns a spec with the measured values filled in.

Sequence features (an EmbeddingCollection's ID lists) are counted the same way: their pooling is the
mean sequence length, their unique ratio one minus the rate at which IDs repeat within a rank's batch,
which is what a unique-based sequence table's traffic scales with.

Batches are duck-typed torchrec KeyedJaggedTensors (KeyedBatch: keys, values, length_per_key, stride_per_key),
counted with their values' own tensor methods, so this module imports neither torch nor torchrec. Weights do not
change what is counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .spec import ModelSpec, TableSpec

_SHOWN_BAD_IDS = 8


@dataclass(frozen=True)
class TableProfile:
    """What the batches showed of one table; `pooling` / `unique_ratio` are None when not measured."""

    table: str
    batches: int  # batches holding at least one of the table's features
    ids: int
    pooling: float | None  # mean IDs per sample per feature; None when no feature was seen
    unique_ratio: float | None  # ID-weighted distinct / total per feature and batch; None without IDs
    max_id: int | None
    unseen_features: tuple[str, ...] = ()  # the table's features absent from every batch

    @property
    def measured(self) -> bool:
        """Whether the returned spec carries this profile's values (a table with no IDs keeps the spec's)."""
        return self.ids > 0

    @property
    def note(self) -> str:
        if not self.batches:
            return "no feature in any batch: spec values kept"
        if not self.ids:
            return "no IDs in any batch: spec values kept"
        return f"unseen features {list(self.unseen_features)}" if self.unseen_features else ""


@dataclass(frozen=True)
class FeatureProfile:
    """The spec with measured values, and the measurements behind it."""

    spec: ModelSpec
    tables: tuple[TableProfile, ...]  # in the spec's table order
    batches: int
    local_batch: int  # the largest stride seen: a last, partial batch is smaller

    def table(self, name: str) -> TableProfile:
        for t in self.tables:
            if t.table == name:
                return t
        raise KeyError(f"no profile of table {name!r}")

    def render(self) -> str:
        """A short text table, one line per table."""
        head = f"{self.batches} batches, local batch {self.local_batch}, spec batch_size {self.spec.batch_size}"
        rows = [f"{'table':<20} {'batches':>7} {'ids':>10} {'pooling':>8} {'unique':>7} {'max id':>10}  note"]
        for t in self.tables:
            rows.append(
                f"{t.table:<20} {t.batches:>7} {t.ids:>10} {_fmt(t.pooling, '{:.3f}'):>8} "
                f"{_fmt(t.unique_ratio, '{:.3f}'):>7} {_fmt(t.max_id, '{}'):>10}  {t.note}".rstrip()
            )
        return "\n".join([head, *rows])

    def __str__(self) -> str:
        return self.render()


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


class _Counts:
    """Running sums for one feature."""

    def __init__(self) -> None:
        self.batches = self.ids = self.samples = self.distinct = 0
        self.max_id = -1


class KeyedBatch(Protocol):
    """What profile_features reads of a batch: a torchrec KeyedJaggedTensor's keys and IDs per key."""

    def keys(self) -> list[str]: ...

    def values(self) -> Any: ...  # the IDs, a tensor

    def length_per_key(self) -> list[int]: ...

    def stride_per_key(self) -> list[int]: ...


def profile_features(
    batches: Iterable[KeyedBatch],
    model: Any,
    world_size: int | None = None,
) -> FeatureProfile:
    """Measure each table's pooling and unique ratio on one rank's batches; return the updated spec.

    `model` is a ModelSpec, an EmbeddingBagCollection or an EmbeddingCollection (via
    ModelSpec.from_module: its tables are sequence tables; batch_size is 65536 unless `world_size`
    is given). Per table:
    - pooling = the mean over its seen features of (IDs / samples over all batches), the convention
      of ModelSpec.from_module (table pooling = mean of its features' pooling factors);
    - unique ratio = sum of distinct IDs / sum of IDs over every (feature, batch): the ratio of
      the IDs themselves, as the cost model multiplies it by IDs; small batches, whose ratio is
      high and noisy, count for little.
    With `world_size`, batch_size becomes the local batch x world_size, so that the measured
    unique ratio is the one of the batch the planner assumes per rank (the ratio holds for this
    local batch only: a spec's unique_ratio overrides the planner's own estimate at any world size).
    A table with no IDs keeps its spec values (its profile says so).
    Raises ValueError on no batches, a feature of no table, or an ID outside the table's rows.
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_module(model)
    owner = {f: t for t in spec.tables for f in t.feature_names}
    counts = {f: _Counts() for f in owner}
    table_batches = {t.name: 0 for t in spec.tables}
    n_batches = local_batch = 0
    for kjt in batches:
        for name in _count_batch(kjt, n_batches, spec, owner, counts):
            table_batches[name] += 1
        n_batches += 1
        local_batch = max([local_batch, *kjt.stride_per_key()])
    if not n_batches:
        raise ValueError("profile_features got no batches")

    profiles = tuple(_table_profile(t.name, t.feature_names, table_batches[t.name], counts) for t in spec.tables)
    tables = tuple(
        replace(t, pooling=p.pooling, unique_ratio=p.unique_ratio) if p.measured else t
        for t, p in zip(spec.tables, profiles)
    )
    batch_size = spec.batch_size if world_size is None else local_batch * world_size
    new_spec = replace(spec, tables=tables, batch_size=batch_size)
    return FeatureProfile(new_spec, profiles, n_batches, local_batch)


def _count_batch(
    kjt: KeyedBatch, index: int, spec: ModelSpec, owner: dict[str, TableSpec], counts: dict[str, _Counts]
) -> set[str]:
    """Add one batch to the per-feature counts; return the names of the tables it touched."""
    touched: set[str] = set()
    keys = list(kjt.keys())
    per_key = kjt.values().split(list(kjt.length_per_key()))
    for key, values, stride in zip(keys, per_key, kjt.stride_per_key()):
        table = owner.get(key)
        if table is None:
            raise ValueError(
                f"feature {key!r} (batch {index}) belongs to no table of model {spec.name!r}; "
                f"known features: {sorted(owner)}"
            )
        touched.add(table.name)
        c = counts[key]
        c.batches += 1
        c.samples += int(stride)
        if not values.numel():
            continue
        distinct = values.unique()
        bad = distinct[(distinct < 0) | (distinct >= table.rows)]
        if bad.numel():
            shown = bad[:_SHOWN_BAD_IDS].tolist() + (["..."] if bad.numel() > _SHOWN_BAD_IDS else [])
            raise ValueError(
                f"table {table.name!r} feature {key!r} (batch {index}): {bad.numel()} distinct IDs outside "
                f"[0, {table.rows}): {shown}"
            )
        c.ids += values.numel()
        c.distinct += distinct.numel()
        c.max_id = max(c.max_id, int(distinct[-1]))  # unique() sorts
    return touched


def _table_profile(name: str, features: tuple[str, ...], batches: int, counts: dict[str, _Counts]) -> TableProfile:
    seen = [counts[f] for f in features if counts[f].batches]
    ids = sum(c.ids for c in seen)
    samples_seen = [c for c in seen if c.samples]
    return TableProfile(
        table=name,
        batches=batches,
        ids=ids,
        pooling=sum(c.ids / c.samples for c in samples_seen) / len(samples_seen) if samples_seen else None,
        unique_ratio=sum(c.distinct for c in seen) / ids if ids else None,
        max_id=max(c.max_id for c in seen) if ids else None,
        unseen_features=tuple(f for f in features if not counts[f].batches),
    )
