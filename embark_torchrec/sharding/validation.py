"""Input checks at the door of the sharded EBC: bad input fails loudly, before any collective.

TorchRec's own shardings trust their input: an ID past a table's rows reads another table's rows or
memory, a KJT whose lengths disagree with its values shifts every bag after the fault. Every batch
is checked here once, for every sharding type, and refused with an error that names the rank and
the feature (and the table for IDs). IDs outside [0, rows) may instead be clamped into range or
dropped (their bags get shorter), when the sharder is built with invalid_ids="clamp" / "drop".
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

INVALID_ID_POLICIES = ("raise", "clamp", "drop")
_SHOWN = 5


class InvalidInputError(ValueError):
    """A batch the sharded EBC cannot run; the message names the rank and the features."""


class InvalidIdError(InvalidInputError):
    """An ID outside [0, rows) of its table; the message names table, feature and rank."""


class InputValidator:
    """Checks (and under clamp / drop, repairs) one rank's KeyedJaggedTensor for an EBC's features.

    One host sync per batch: the IDs per key come from the KJT's own length_per_key (which
    TorchRec's input dist reads anyway, and the KJT caches), and every device-side check is read
    back at once. Per key order, the missing features and each key's table rows are worked out once.
    """

    def __init__(
        self, table_features: Dict[str, List[str]], table_rows: Dict[str, int], rank: int, invalid_ids: str = "raise"
    ) -> None:
        if invalid_ids not in INVALID_ID_POLICIES:
            raise ValueError(f"invalid_ids must be one of {INVALID_ID_POLICIES}, got {invalid_ids!r}")
        # a feature read by several tables must be a valid row of each: it is checked against the smallest
        self._feature_tables: Dict[str, str] = {}
        for table, features in table_features.items():
            for f in features:
                known = self._feature_tables.get(f)
                if known is None or table_rows[table] < table_rows[known]:
                    self._feature_tables[f] = table
        self._table_rows = table_rows
        self._rank, self._policy = rank, invalid_ids
        self._rows: Dict[tuple, torch.Tensor] = {}  # per key order: each key's table rows (-1: not ours)

    def _rows_of(self, keys: List[str], device: torch.device) -> torch.Tensor:
        order = tuple(keys)
        rows = self._rows.get(order)
        if rows is None or rows.device != device:
            known = self._feature_tables
            present = set(keys)
            missing = [f for f in known if f not in present]
            if missing:
                raise InvalidInputError(
                    f"rank {self._rank}: features {missing} are missing from the KeyedJaggedTensor (it has {keys})"
                )
            rows = self._rows[order] = torch.tensor(
                [self._table_rows[known[k]] if k in known else -1 for k in keys], device=device
            )
        return rows

    def __call__(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        keys: List[str] = kjt.keys()
        if kjt.values().is_floating_point() or kjt.values().dtype == torch.bool:
            raise InvalidInputError(
                f"rank {self._rank}: the KeyedJaggedTensor's IDs are {kjt.values().dtype}; IDs must be integers "
                "(torch.int64 or torch.int32), as rows of their tables"
            )
        rows = self._rows_of(keys, kjt.values().device)
        lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
        per_key = kjt.length_per_key()
        total = sum(per_key)
        if total != values.numel() or (weights is not None and weights.numel() != values.numel()):
            detail = "" if weights is None else f" and {weights.numel()} weights"
            raise InvalidInputError(
                f"rank {self._rank}: the bag lengths add up to {total} IDs, but the KeyedJaggedTensor holds "
                f"{values.numel()} values{detail}"
            )
        limit = rows.repeat_interleave(torch.tensor(per_key, device=values.device), output_size=total)
        bad = (limit >= 0) & ((values < 0) | (values >= limit))
        negative, any_bad = torch.stack([(lengths < 0).any(), bad.any()]).tolist()
        if negative:
            raise InvalidInputError(f"rank {self._rank}: negative bag lengths in the KeyedJaggedTensor")
        if not any_bad:
            return kjt
        if self._policy == "raise":
            key_of = torch.repeat_interleave(
                torch.arange(len(keys), device=values.device), torch.tensor(per_key, device=values.device)
            )
            k = int(key_of[bad][0])
            feature = keys[k]
            sample = values[bad & (key_of == k)][:_SHOWN].tolist()
            raise InvalidIdError(
                f"rank {self._rank}: feature {feature!r} of table {self._feature_tables[feature]!r} has IDs {sample} "
                f"outside [0, {int(rows[k])}) ({int(bad.sum())} bad IDs in this batch)"
            )
        if self._policy == "clamp":
            fixed = torch.where(bad, torch.where(values < 0, torch.zeros_like(values), limit - 1), values)
            return _rebuilt(kjt, fixed, lengths, weights)
        keep = ~bad
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths.long())
        kept = torch.zeros_like(lengths).index_add_(0, bag, keep.to(lengths.dtype))
        return _rebuilt(kjt, values[keep], kept, weights[keep] if weights is not None else None)


def _rebuilt(
    kjt: KeyedJaggedTensor, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
) -> KeyedJaggedTensor:
    """`kjt` with new values, lengths and weights, keeping its batch layout (also a variable batch per feature)."""
    if kjt.variable_stride_per_key():
        return KeyedJaggedTensor(
            keys=kjt.keys(),
            values=values,
            lengths=lengths,
            weights=weights,
            stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
            inverse_indices=kjt.inverse_indices_or_none(),
        )
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths, weights=weights, stride=kjt.stride())


def check_equal_batches(batch_size_per_rank: List[int], rank: int, sharding_type: str) -> None:
    """TorchRec's row-wise and table-row-wise output dists reduce-scatter one block per rank, so every
    rank must send the same number of samples (unless the batch is a variable-batch KJT); checked
    once the input dist has exchanged the batch sizes, on every rank alike, before the reduce-scatter."""
    if len(set(batch_size_per_rank)) > 1:
        sizes = ", ".join(f"rank {r}: {b}" for r, b in enumerate(batch_size_per_rank))
        raise InvalidInputError(
            f"rank {rank}: TorchRec's {sharding_type} sharding needs the same batch size on every rank, got {sizes}; "
            "pad the batches, pass a variable-batch KeyedJaggedTensor, or shard these tables another way"
        )
