"""The DLRM example's data: seeded synthetic batches (SyntheticData) or TorchRec's binary Criteo files
(CriteoData), both as torchrec Batches that are a pure function of (step, rank).

Synthetic: Zipf IDs, fixed multi-hot bags and a learnable click label.

Why a pure function of (seed, split, step, rank): every planner trains on identical samples, and a run
resumed from a checkpoint at step k continues the very stream an uninterrupted run would have seen.

Each feature of a table draws `round(pooling)` IDs per sample (at least one) from the table's ID
distribution: Zipf(alpha) over popularity ranks (exact for the hottest ranks, the continuous power
law for the tail, so tables of any size need no per-row arrays) or uniform. Popularity ranks are
hashed onto rows by a bijection, since the planner's cost model assumes hot IDs sit at no particular
row positions (as with hashed inputs).

The label is Bernoulli(sigmoid(logit)), with logit = a hidden score per row averaged over the bag,
summed over a few "label features", plus a fixed linear function of the dense features. So a model
has to learn both embeddings (of the label features' rows) and dense weights to predict it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan import ModelSpec

__all__ = ["CriteoData", "DataSource", "SyntheticData", "SyntheticFeature"]

SPLITS = {"train": 0, "heldout": 1}
DENSE_FEATURES = 13  # as in Criteo
LABEL_FEATURES = 3
SPARSE_SIGNAL = 1.5  # logit scale of the summed per-row scores (each of unit variance)
DENSE_SIGNAL = 1.0  # logit scale of the dense part (unit variance)
_ROW_HASH = 2654435761  # a prime: k -> (k * prime + salt) mod rows is a bijection for rows < prime
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
CRITEO_HELDOUT_FRACTION_OF_LAST_DAY = 0.5  # torchrec's "test" half of the last day


@dataclass(frozen=True)
class SyntheticFeature:
    """One sparse feature: its table's rows, IDs per sample, and Zipf alpha (None: uniform)."""

    name: str
    rows: int
    ids_per_sample: int
    alpha: float | None


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash (SplitMix64's finaliser); uint64 arithmetic wraps."""
    with np.errstate(over="ignore"):
        z = (x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class _Zipf:
    """Popularity ranks 0..rows-1 with P(rank k) proportional to (k + 1)^-alpha.

    The hottest ranks are drawn exactly (inverse CDF over their weights); the tail from the continuous
    power law x^-alpha on [head + 0.5, rows + 0.5], rounded: the midpoint rule, accurate where
    weights change slowly. Memory is O(head) whatever the table size.
    """

    HEAD = 1024

    def __init__(self, rows: int, alpha: float) -> None:
        self.rows, self.alpha = rows, alpha
        head = min(rows, self.HEAD)
        weights = np.arange(1, head + 1, dtype=np.float64) ** -alpha
        self._lo, self._hi = head + 0.5, rows + 0.5
        tail = self._antiderivative(self._hi) - self._antiderivative(self._lo) if rows > head else 0.0
        total = weights.sum() + tail
        self._head_cdf = np.cumsum(weights) / total
        self._head_mass = float(self._head_cdf[-1])

    def _antiderivative(self, x: float | np.ndarray) -> float | np.ndarray:
        a = self.alpha
        return np.log(x) if abs(a - 1.0) < 1e-9 else x ** (1.0 - a) / (1.0 - a)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        u = rng.random(size)
        ranks = np.searchsorted(self._head_cdf, u, side="right").astype(np.int64)
        in_tail = u >= self._head_mass
        if in_tail.any():
            # the tail's CDF, inverted: F(x) = (A(x) - A(lo)) / (A(hi) - A(lo)) with A the antiderivative
            v = (u[in_tail] - self._head_mass) / (1.0 - self._head_mass)
            a_lo, a_hi = self._antiderivative(self._lo), self._antiderivative(self._hi)
            target = a_lo + v * (a_hi - a_lo)
            a = self.alpha
            x = np.exp(target) if abs(a - 1.0) < 1e-9 else (target * (1.0 - a)) ** (1.0 / (1.0 - a))
            ranks[in_tail] = np.floor(x + 0.5).astype(np.int64) - 1
        return np.clip(ranks, 0, self.rows - 1)


class SyntheticData:
    """The batches of one model spec: `batch(step, rank)` is rank `rank`'s slice of global step `step`.

    `batch_size` is per rank. The first `label_features` features carry the label's sparse signal.
    """

    def __init__(
        self,
        spec: ModelSpec,
        batch_size: int,
        seed: int = 0,
        dense_features: int = DENSE_FEATURES,
        label_features: int = LABEL_FEATURES,
    ) -> None:
        self.batch_size = batch_size
        self.seed = seed
        self.dense_features = dense_features
        features = []
        for t in spec.tables:
            dist = spec.distribution(t)
            alpha = dist.alpha if dist.kind == "zipf" else None
            if t.rows >= _ROW_HASH:
                raise ValueError(f"table {t.name!r}: {t.rows} rows is beyond the synthetic ID hash ({_ROW_HASH})")
            features += [SyntheticFeature(f, t.rows, max(1, round(t.pooling)), alpha) for f in t.feature_names]
        self.features = tuple(features)
        self._zipf = [_Zipf(f.rows, f.alpha) if f.alpha is not None else None for f in self.features]
        self.label_features = self.features[:label_features]
        fixed = np.random.default_rng(np.random.SeedSequence([seed, len(SPLITS)]))
        self._dense_weight = fixed.standard_normal(dense_features) / np.sqrt(dense_features)
        self._salts = fixed.integers(0, 2**62, size=len(self.features), dtype=np.int64)

    @property
    def keys(self) -> list[str]:
        return [f.name for f in self.features]

    def row_score(self, feature: int, ids: np.ndarray) -> np.ndarray:
        """The hidden per-row score of a label feature: uniform with mean 0 and variance 1."""
        h = _splitmix64(ids.astype(np.uint64) ^ np.uint64(self._salts[feature]))
        u = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53
        return np.sqrt(3.0) * (2.0 * u - 1.0)

    def _ids(self, rng: np.random.Generator, index: int) -> np.ndarray:
        f = self.features[index]
        n = self.batch_size * f.ids_per_sample
        zipf = self._zipf[index]
        if zipf is None:
            return rng.integers(0, f.rows, size=n, dtype=np.int64)
        ranks = zipf.sample(rng, n)
        return (ranks * _ROW_HASH + int(self._salts[index] % f.rows)) % f.rows

    def arrays(self, step: int, rank: int, split: str = "train") -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """(dense [B, D] float32, ids per feature [B, ids_per_sample] int64, labels [B] float32)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[split], step, rank]))
        b = self.batch_size
        dense = rng.standard_normal((b, self.dense_features)).astype(np.float32)
        ids = [self._ids(rng, i).reshape(b, f.ids_per_sample) for i, f in enumerate(self.features)]
        sparse = sum(self.row_score(i, ids[i]).mean(axis=1) for i in range(len(self.label_features)))
        logit = DENSE_SIGNAL * dense.astype(np.float64) @ self._dense_weight
        if self.label_features:
            logit = logit + SPARSE_SIGNAL * sparse / np.sqrt(len(self.label_features))
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return dense, ids, labels

    def batch(self, step: int, rank: int, split: str = "train") -> Batch:
        """The torchrec Batch of (step, rank): keys in spec order, every bag of a feature the same length."""
        dense, ids, labels = self.arrays(step, rank, split)
        lengths = np.concatenate([np.full(self.batch_size, f.ids_per_sample, dtype=np.int32) for f in self.features])
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=self.keys,
                values=torch.from_numpy(np.concatenate([a.reshape(-1) for a in ids])),
                lengths=torch.from_numpy(lengths),
            ),
            labels=torch.from_numpy(labels),
        )


class DataSource(Protocol):
    dense_features: int

    def batch(self, step: int, rank: int, split: str = "train") -> Batch: ...


class CriteoData:
    """TorchRec's binary Criteo layout, memory-mapped. Held out: the second half of the last day (torchrec's
    "test" stage); train: everything before, cycled. Like the synthetic data, batch(step, rank) is a pure
    function of its arguments, so a resumed run continues the stream. IDs are hashed into the tables by
    modulo, as torchrec's `hashes` do."""

    def __init__(self, directory: Path, spec: ModelSpec, batch_size: int, world_size: int) -> None:
        days = sorted(directory.glob("day_*_dense.npy"), key=lambda p: int(p.name.split("_")[1]))
        if not days:
            raise SystemExit(f"{directory}: no day_<i>_dense.npy files (TorchRec's binary Criteo layout)")
        self.dense, self.sparse, self.labels = (
            [np.load(str(p).replace("_dense.npy", f"_{kind}.npy"), mmap_mode="r") for p in days]
            for kind in ("dense", "sparse", "labels")
        )
        self.starts = np.cumsum([0] + [len(a) for a in self.dense])
        last = len(self.dense[-1])
        self.train_rows = int(self.starts[-1] - round(last * CRITEO_HELDOUT_FRACTION_OF_LAST_DAY))
        self.heldout_rows = int(self.starts[-1]) - self.train_rows
        self.batch_size, self.world_size = batch_size, world_size
        self.dense_features = self.dense[0].shape[1]
        self.keys = [f for t in spec.tables for f in t.feature_names]
        self.rows = np.array([t.rows for t in spec.tables for _ in t.feature_names], dtype=np.int64)

    @staticmethod
    def columns(directory: Path) -> int:
        """Categorical columns in the files (26 for Criteo)."""
        first = next(iter(sorted(directory.glob("day_*_sparse.npy"))), None)
        if first is None:
            raise SystemExit(f"{directory}: no day_<i>_sparse.npy files (TorchRec's binary Criteo layout)")
        return int(np.load(first, mmap_mode="r").shape[1])

    def _gather(self, arrays: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
        day = np.searchsorted(self.starts, rows, side="right") - 1
        out = np.empty((len(rows),) + arrays[0].shape[1:], dtype=arrays[0].dtype)
        for d in np.unique(day):
            here = day == d
            out[here] = arrays[d][rows[here] - self.starts[d]]
        return out

    def batch(self, step: int, rank: int, split: str = "train") -> Batch:
        first, size = (0, self.train_rows) if split == "train" else (self.train_rows, self.heldout_rows)
        offset = (step * self.world_size + rank) * self.batch_size
        rows = first + (offset + np.arange(self.batch_size)) % size
        sparse = self._gather(self.sparse, rows).astype(np.int64) % self.rows
        b = self.batch_size
        return Batch(
            dense_features=torch.from_numpy(self._gather(self.dense, rows).astype(np.float32)),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=self.keys,
                values=torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1)),
                lengths=torch.ones(b * len(self.keys), dtype=torch.int32),
            ),
            labels=torch.from_numpy(self._gather(self.labels, rows).reshape(-1).astype(np.float32)),
        )
