"""Deterministic sparse input for equality tests: every rank builds the same global batch and takes its slice."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["global_kjt_batch", "ids_per_row_slice"]

_ID_KINDS = ("uniform", "zipf", "distinct")
ZIPF_ALPHA = 1.1


def _draw(kind: str, rows: int, n: int, generator: torch.Generator, feature: str) -> torch.Tensor:
    if kind == "uniform":
        return torch.randint(0, rows, (n,), generator=generator)
    if kind == "zipf":
        p = torch.arange(1, rows + 1, dtype=torch.float64) ** -ZIPF_ALPHA
        return torch.multinomial(p, n, replacement=True, generator=generator) if n else torch.empty(0, dtype=torch.long)
    if n > rows:
        raise ValueError(f"feature {feature!r}: {n} distinct IDs asked of a table of {rows} rows")
    return torch.randperm(rows, generator=generator)[:n]


def global_kjt_batch(
    tables: Sequence[BaseEmbeddingConfig],
    world_size: int,
    batch_size: int,
    seed: int,
    max_bag_size: int = 4,
    empty_fraction: float = 0.25,
    weighted: bool = False,
    ids: str = "uniform",
    variable_batch: bool = False,
) -> list[KeyedJaggedTensor]:
    """The global batch as ``world_size`` KJTs of ``batch_size`` samples each (rank r feeds element r).

    Built from ``seed`` alone, so every rank (and the unsharded reference) gets identical tensors. Keys are the
    tables' feature names in table order, each once (a feature read by several tables takes IDs valid in all of
    them); ids are valid rows of the feature's tables. A fraction of bags is empty,
    and every feature has at least one empty bag per slice, since empty bags are a classic source of pooling bugs.
    ``weighted`` adds a per-ID weight in [0.5, 1.5). ``ids``: "uniform" over the rows; "zipf" (Zipf(1.1) over the
    rows: heavy repetition, for de-duplication); "distinct" (no ID twice in a feature of one slice).
    ``variable_batch`` makes each slice a VBE KJT, as TorchRec's EBC takes it: feature f keeps its first B_f bags
    (B_f drawn in [1, batch_size]) and inverse indices map each of the batch_size samples to one of them.
    """
    if batch_size < 1 or world_size < 1:
        raise ValueError("world_size and batch_size must be >= 1")
    if ids not in _ID_KINDS:
        raise ValueError(f"ids must be one of {_ID_KINDS}, got {ids!r}")
    rows: dict[str, int] = {}  # a feature read by several tables: once, with IDs valid in all of them
    for table in tables:
        for name in table.feature_names:
            rows[name] = min(rows.get(name, table.num_embeddings), table.num_embeddings)
    features = list(rows.items())
    generator = torch.Generator().manual_seed(seed)
    slices: list[KeyedJaggedTensor] = []
    for _ in range(world_size):
        lengths = torch.randint(1, max_bag_size + 1, (len(features), batch_size), generator=generator)
        lengths[torch.rand(lengths.shape, generator=generator) < empty_fraction] = 0
        for index in range(len(features)):
            lengths[index, index % batch_size] = 0
        values = [
            _draw(ids, rows, int(lengths[index].sum()), generator, name) for index, (name, rows) in enumerate(features)
        ]
        flat = torch.cat(values) if values else torch.empty(0, dtype=torch.long)
        weights = torch.rand(flat.numel(), generator=generator) + 0.5 if weighted else None
        keys = [name for name, _ in features]
        if variable_batch:
            slices.append(_variable_batch(keys, flat, lengths, weights, generator))
        else:
            slices.append(
                KeyedJaggedTensor.from_lengths_sync(keys=keys, values=flat, lengths=lengths.flatten(), weights=weights)
            )
    return slices


def _variable_batch(
    keys: list[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    generator: torch.Generator,
) -> KeyedJaggedTensor:
    """Feature f of a [features, batch] slice cut to its first B_f bags, with inverse indices over them."""
    n_features, batch = lengths.shape
    kept = torch.randint(1, batch + 1, (n_features,), generator=generator)
    keep_bag = torch.arange(batch)[None, :] < kept[:, None]
    keep_id = keep_bag.flatten().repeat_interleave(lengths.flatten())
    inverse = torch.stack([torch.randint(0, int(k), (batch,), generator=generator) for k in kept])
    return KeyedJaggedTensor(
        keys=keys,
        values=values[keep_id],
        lengths=lengths[keep_bag],
        weights=weights[keep_id] if weights is not None else None,
        stride_per_key_per_rank=[[int(k)] for k in kept],
        inverse_indices=(keys, inverse),
    )


def ids_per_row_slice(
    batches: Sequence[KeyedJaggedTensor], feature_names: Sequence[str], row_bounds: Sequence[int], unique: bool
) -> np.ndarray:
    """[ranks, features, row slices]: the IDs (distinct IDs when `unique`, as a unique-based table sends them)
    each rank's batch holds per feature in each row slice: what the traffic model needs to predict the bytes
    of that batch exactly."""
    out = np.zeros((len(batches), len(feature_names), len(row_bounds) - 1))
    for s, kjt in enumerate(batches):
        per = kjt.to_dict()
        for f, feature in enumerate(feature_names):
            ids = per[feature].values()
            ids = torch.unique(ids) if unique else ids
            for r in range(len(row_bounds) - 1):
                out[s, f, r] = int(((ids >= row_bounds[r]) & (ids < row_bounds[r + 1])).sum())
    return out
