"""The sequence example's synthetic data: a user history (a variable-length sequence of item IDs) for an
EmbeddingCollection, a few one-hot and multi-hot features for an EmbeddingBagCollection, and a click label.

Batches are a pure function of (seed, split, step, rank), so every planner trains on identical samples.

History lengths are uniform on [min_length, max_length]; history IDs are Zipf(alpha) popularity ranks over the
whole table (truncated Zipf, drawn exactly by rejection), hashed onto rows by a bijection so hot IDs sit at no
particular row positions; the pooled features draw their IDs the same way. The label is Bernoulli(sigmoid(logit))
with logit = a hidden per-row score summed over the history (scaled by 1/sqrt(length)) plus the hidden scores of
the one-hot features' IDs, so a model has to learn the history's and the features' embeddings to predict it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

__all__ = ["PooledFeature", "SequenceBatch", "SequenceData"]

SPLITS = {"train": 0, "heldout": 1}
HISTORY = "history"  # the history's feature and table name
_ROW_HASH = 2654435761  # a prime: k -> (k * prime + salt) mod rows is a bijection when the prime does not divide rows
_SCORE_HASH = 0x9E3779B1


@dataclass(frozen=True)
class PooledFeature:
    """One feature of the EmbeddingBagCollection: its table's rows, IDs per sample, and whether it drives the label."""

    name: str
    rows: int
    ids_per_sample: int
    in_label: bool


@dataclass
class SequenceBatch(Pipelineable):
    """One rank's samples: the history KJT (for the EC), the pooled features' KJT (for the EBC), the labels."""

    history: KeyedJaggedTensor
    features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "SequenceBatch":
        return SequenceBatch(
            self.history.to(device, non_blocking=non_blocking),
            self.features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.history.record_stream(stream)
        self.features.record_stream(stream)
        self.labels.record_stream(stream)  # type: ignore[arg-type]

    def pin_memory(self) -> "SequenceBatch":
        return SequenceBatch(self.history.pin_memory(), self.features.pin_memory(), self.labels.pin_memory())


def zipf_rows(rng: np.random.Generator, rows: int, alpha: float, size: int, salt: int) -> np.ndarray:
    """`size` rows whose popularity ranks follow Zipf(alpha) truncated to the table (numpy's unbounded Zipf with
    draws past the table drawn again, which is exact), hashed onto rows."""
    ranks = np.empty(0, dtype=np.int64)
    while ranks.size < size:
        draw = rng.zipf(alpha, 2 * (size - ranks.size) + 16)
        ranks = np.concatenate([ranks, draw[draw <= rows][: size - ranks.size] - 1])
    return (ranks * _ROW_HASH + salt) % rows


def row_score(rows: np.ndarray, salt: int) -> np.ndarray:
    """A fixed hidden score per row, uniform with unit variance."""
    mixed = (rows.astype(np.uint64) * np.uint64(_SCORE_HASH) + np.uint64(salt)) % np.uint64(1 << 32)
    return (mixed.astype(np.float64) / float(1 << 32) - 0.5) * np.sqrt(12.0)


class SequenceData:
    """`batch(step, rank)` is rank `rank`'s slice (`batch_size` samples) of global step `step`."""

    def __init__(
        self,
        history_rows: int,
        features: Sequence[PooledFeature],
        batch_size: int,
        alpha: float = 1.1,
        min_length: int = 1,
        max_length: int = 100,
        seed: int = 0,
    ) -> None:
        self.history_rows, self.features, self.batch_size = history_rows, tuple(features), batch_size
        self.alpha, self.min_length, self.max_length, self.seed = alpha, min_length, max_length, seed

    def arrays(self, step: int, rank: int, split: str = "train") -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
        """History lengths and IDs, each pooled feature's IDs ([batch, ids_per_sample]), and labels."""
        rng = np.random.default_rng([self.seed, SPLITS[split], step, rank])
        b = self.batch_size
        lengths = rng.integers(self.min_length, self.max_length + 1, size=b)
        history = zipf_rows(rng, self.history_rows, self.alpha, int(lengths.sum()), salt=self.seed)
        pooled = [
            zipf_rows(rng, f.rows, self.alpha, b * f.ids_per_sample, salt=self.seed + i + 1).reshape(b, -1)
            for i, f in enumerate(self.features)
        ]
        sample = np.repeat(np.arange(b), lengths)
        logit = np.bincount(sample, weights=row_score(history, 0), minlength=b) / np.sqrt(lengths)
        for i, (f, ids) in enumerate(zip(self.features, pooled)):
            if f.in_label:
                logit += row_score(ids, i + 1).mean(axis=1)
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return lengths, history, pooled, labels

    def batch(self, step: int, rank: int, split: str = "train") -> SequenceBatch:
        lengths, history, pooled, labels = self.arrays(step, rank, split)
        history_kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[HISTORY], values=torch.from_numpy(history), lengths=torch.from_numpy(lengths).int()
        )
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=[f.name for f in self.features],
            values=torch.from_numpy(np.concatenate([ids.ravel() for ids in pooled])),
            lengths=torch.cat(
                [torch.full((self.batch_size,), f.ids_per_sample, dtype=torch.int32) for f in self.features]
            ),
        )
        return SequenceBatch(history_kjt, features, torch.from_numpy(labels))
