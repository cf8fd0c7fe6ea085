"""Input checks at the door of the sharded EBC and EC: bad input fails loudly, on every rank, before any collective
that could not complete.

TorchRec's own shardings trust their input: an ID past a table's rows reads another table's rows or memory, a KJT
whose lengths disagree with its values shifts every bag after the fault, uint8 or int16 IDs fail inside fbgemm or
gloo, NaN weights poison the table through the fused optimizer, per-sample weights sent to an unweighted collection
are applied by some sharding types and dropped by others (and a weighted one without them sums its IDs unweighted);
a batch that is no KJT, 2-D tensors, lengths that do not make keys x batch bags, a feature given twice and VBE inverse
indices outside their feature's bags fail on the bad rank alone, while its peers wait in an all-to-all.
Every batch is checked here once, for every sharding type. The check does not raise: it returns an `InputFault`, a
fixed-size record that the module's split exchange (input_exchange.py) carries to every rank, so that all ranks raise
the same error (`InputValidator.error`), naming the bad rank, the feature (and table) and what is wrong. IDs outside
[0, rows) may instead be clamped into range or dropped (their bags get shorter), when the sharder is built with
invalid_ids="clamp" / "drop".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

INVALID_ID_POLICIES = ("raise", "clamp", "drop")
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.float64)  # fbgemm's bucketing (row-wise, grid) has no float16 / bfloat16 kernel
_SHOWN = 5
# dtypes a fault record names by position (-1: another dtype)
_DTYPES = tuple(
    getattr(torch, name)
    for name in (
        "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 "
        "complex32 complex64 complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
    ).split()
    if hasattr(torch, name)
)


class InvalidInputError(ValueError):
    """A batch the sharded module cannot run; the message names the rank and the features."""


class InvalidIdError(InvalidInputError):
    """An ID outside [0, rows) of its table; the message names table, feature and rank."""


# what an InputFault reports (its kind)
OK, ID_DTYPE, LENGTHS_DTYPE, WEIGHTS_DTYPE, MISSING, COUNTS = range(6)
NEGATIVE_LENGTH, NON_FINITE_WEIGHT, BAD_ID, VARIABLE_BATCH = range(6, 10)
UNEXPECTED_WEIGHTS, NO_WEIGHTS, NOT_A_KJT, SHAPE, LENGTHS_COUNT, DUPLICATE_KEYS, INVERSE_INDICES = range(10, 17)
EMPTY_BATCH = 17
# what the module got instead of a KeyedJaggedTensor (NOT_A_KJT's first number)
_INSTEAD = ("an object that is not a KeyedJaggedTensor", "None", "a dict", "a torch.Tensor")
# what is wrong with a VBE batch's inverse indices (INVERSE_INDICES's first number)
_NO_INVERSE, _INVERSE_TENSOR, _INVERSE_KEY, _INVERSE_RANGE = range(4)


@dataclass(frozen=True)
class InputFault:
    """What is wrong with one rank's batch, as integers that travel in the split exchange: `kind`, the feature
    (an index into the module's features, -1 for none), up to three numbers and up to five shown values (IDs, or
    the indices of the features it names: missing ones, or those whose weights are wrong). Which fields a kind fills
    is in `InputValidator.describe`."""

    kind: int
    feature: int = -1
    numbers: Tuple[int, int, int] = (0, 0, 0)
    shown: Tuple[int, ...] = ()

    FIELDS = 6 + _SHOWN  # kind, feature, three numbers, how many shown, shown

    def to_ints(self) -> List[int]:
        return [self.kind, self.feature, *self.numbers, len(self.shown), *self.shown] + [0] * (_SHOWN - len(self.shown))

    @classmethod
    def from_ints(cls, ints: List[int]) -> "InputFault":
        kind, feature, a, b, c, n = ints[:6]
        return cls(kind, feature, (a, b, c), tuple(ints[6 : 6 + n]))


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype by its position in the dtypes a fault record can name (-1: another)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "an unsupported dtype"


def not_a_kjt(features: object) -> InputFault:
    """The fault of a batch that is no KeyedJaggedTensor (None, a dict of tensors, ...): TorchRec's input dist would
    raise an AttributeError on that rank alone, while its peers wait in the all-to-all."""
    instead = 1 if features is None else 2 if isinstance(features, dict) else 3 if torch.is_tensor(features) else 0
    return InputFault(NOT_A_KJT, numbers=(instead, 0, 0))


class InputValidator:
    """Checks (and under clamp / drop, repairs) one rank's KeyedJaggedTensor for a module's features.

    One host sync per batch: the IDs per key come from the KJT's own length_per_key (which TorchRec's input dist
    reads anyway, and the KJT caches), and every device-side check (negative lengths, IDs out of range, non-finite
    weights) is read back at once; dtypes are checked on the host. Per key order, the missing features and each
    key's table rows are worked out once. Where every key of the batch is a feature of tables of one row count (all
    of dlrm_main.py's 26, say), the range check is the IDs' smallest and largest and the sign check the lengths'
    smallest (three ops, where a bound per ID takes eight); the bound per ID is built only to name or repair a bad
    batch. Features are indexed in the module's config order, the same on every rank.
    """

    def __init__(
        self,
        table_features: Dict[str, List[str]],
        table_rows: Dict[str, int],
        invalid_ids: str = "raise",
        uniform_batch_features: Sequence[str] = (),
        *,
        weighted: bool,
        collection: str = "EmbeddingBagCollection",
    ) -> None:
        """`uniform_batch_features`: features whose sharding cannot take a variable batch per feature (VBE).
        `weighted`: whether the module takes per-sample weights (EmbeddingBagCollection.is_weighted(); an
        EmbeddingCollection takes none), which a batch must then have, and otherwise must not; `collection`: the
        module's class, as errors name it."""
        if invalid_ids not in INVALID_ID_POLICIES:
            raise ValueError(f"invalid_ids must be one of {INVALID_ID_POLICIES}, got {invalid_ids!r}")
        # a feature read by several tables must be a valid row of each: it is checked against the smallest
        self._feature_tables: Dict[str, str] = {}
        for table, features in table_features.items():
            for f in features:
                known = self._feature_tables.get(f)
                if known is None or table_rows[table] < table_rows[known]:
                    self._feature_tables[f] = table
        self._features = list(self._feature_tables)
        self._index = {f: i for i, f in enumerate(self._features)}
        self._table_rows = table_rows
        self._policy = invalid_ids
        self._uniform_only = set(uniform_batch_features)
        self._weighted, self._collection = weighted, collection
        # per key order: each key's table rows (-1: not ours) and their one count when every key is ours and they
        # agree, or the key order's fault
        self._rows: Dict[tuple, Tuple[torch.Tensor, Optional[int]] | InputFault] = {}

    def _rows_of(self, keys: List[str], device: torch.device) -> Tuple[torch.Tensor, Optional[int]] | InputFault:
        """Each key's table rows (-1: not ours) and, when every key is ours and of one row count, that count; or the
        key order's fault: features missing, or given twice (TorchRec would read the first and drop the other's
        IDs)."""
        order = tuple(keys)
        rows = self._rows.get(order)
        if rows is None or (isinstance(rows, tuple) and rows[0].device != device):
            known = self._feature_tables
            present = set(keys)
            missing = [self._index[f] for f in known if f not in present]
            twice = [self._index[k] for k in dict.fromkeys(keys) if k in known and keys.count(k) > 1]
            counts = [self._table_rows[known[k]] if k in known else -1 for k in keys]
            alike = counts[0] if len(set(counts)) == 1 and counts[0] >= 0 else None
            rows = self._rows[order] = (
                _naming(MISSING, missing)
                if missing
                else _naming(DUPLICATE_KEYS, twice)
                if twice
                else (torch.tensor(counts, device=device), alike)
            )
        return rows

    def check(self, kjt: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, Optional[InputFault]]:
        """The batch to send (repaired under clamp / drop) and what is wrong with it (None: nothing)."""
        keys: List[str] = kjt.keys()
        if kjt.lengths_or_none() is None and kjt.offsets_or_none() is None:
            return kjt, InputFault(LENGTHS_COUNT, numbers=(-1, 0, len(keys)))
        lengths, values, weights = kjt.lengths(), kjt.values(), kjt.weights_or_none()
        if values.dtype not in ID_DTYPES:
            return kjt, InputFault(ID_DTYPE, numbers=(dtype_code(values.dtype), 0, 0))
        if lengths.dtype not in ID_DTYPES:
            return kjt, InputFault(LENGTHS_DTYPE, numbers=(dtype_code(lengths.dtype), 0, 0))
        if (weights is not None) != self._weighted:
            return kjt, self._weighting(keys, UNEXPECTED_WEIGHTS if weights is not None else NO_WEIGHTS)
        if weights is not None and weights.dtype not in WEIGHT_DTYPES:
            return kjt, InputFault(WEIGHTS_DTYPE, numbers=(dtype_code(weights.dtype), 0, 0))
        if values.dim() != 1 or lengths.dim() != 1 or (weights is not None and weights.dim() != 1):
            return kjt, InputFault(
                SHAPE, numbers=(values.dim(), lengths.dim(), -1 if weights is None else weights.dim())
            )
        variable = kjt.variable_stride_per_key()
        if self._collection == "EmbeddingCollection" and not variable and kjt.stride() == 0:
            return kjt, InputFault(EMPTY_BATCH)
        if self._uniform_only and variable:
            uniform = [k for k in keys if k in self._uniform_only]
            if uniform:
                return kjt, InputFault(VARIABLE_BATCH, self._index[uniform[0]])
        found = self._rows_of(keys, values.device)
        if isinstance(found, InputFault):
            return kjt, found
        rows, alike = found
        bags = sum(kjt.stride_per_key()) if variable else len(keys) * kjt.stride()
        if lengths.numel() != bags:  # TorchRec's length_per_key would fail on this rank alone
            return kjt, InputFault(LENGTHS_COUNT, numbers=(lengths.numel(), bags, len(keys)))
        inverse = self._inverse_limits(kjt) if variable else None
        if isinstance(inverse, InputFault):
            return kjt, inverse
        if inverse is not None and not kjt.inverse_indices()[1].is_contiguous():
            # TorchRec views them after the output dist, which fails for a slice on this rank alone (its peers then
            # wait in the backward's all-to-all): the same indices, laid out as it needs them
            names, index = kjt.inverse_indices()
            kjt = _rebuilt(kjt, values, lengths, weights, (names, index.contiguous()))
        per_key = kjt.length_per_key()
        total = sum(per_key)
        if total != values.numel() or (weights is not None and weights.numel() != values.numel()):
            counts = (total, values.numel(), -1 if weights is None else weights.numel())
            return kjt, InputFault(COUNTS, numbers=counts)
        bounds = None if alike is not None and total else _bounds(rows, per_key, values, total)
        # one row count: the lengths' least, the IDs' least and greatest; else any negative length, any ID out of bounds
        flags = [lengths.min(), *torch.aminmax(values)] if bounds is None else [(lengths < 0).any(), bounds[1].any()]
        if inverse is not None:
            flags.append(_outside(*inverse).any())
        if weights is not None:
            flags.append(weights.isfinite().all())
        read = torch.stack(flags).tolist()
        checks = 3 if bounds is None else 2
        if bounds is None:
            assert alike is not None
            negative, any_bad = read[0] < 0, read[1] < 0 or read[2] >= alike
        else:
            negative, any_bad = bool(read[0]), bool(read[1])
        if negative:
            return kjt, self._negative_lengths(kjt)
        if inverse is not None and read[checks]:
            return kjt, self._inverse_outside(kjt, *inverse)
        finite = weights is None or bool(read[-1])
        if not any_bad and finite:
            return kjt, None
        limit, bad = bounds or _bounds(rows, per_key, values, total)
        if not finite:
            assert weights is not None
            fault = self._non_finite_weights(keys, per_key, weights, limit)
            if fault is not None:  # else only keys this module does not read have them
                return kjt, fault
        if not any_bad:
            return kjt, None
        if self._policy == "raise":
            return kjt, self._bad_ids(keys, per_key, values, bad, rows)
        if self._policy == "clamp":
            fixed = torch.where(bad, torch.where(values < 0, torch.zeros_like(values), limit - 1), values)
            return _rebuilt(kjt, fixed, lengths, weights), None
        keep = ~bad
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths.long())
        kept = torch.zeros_like(lengths).index_add_(0, bag, keep.to(lengths.dtype))
        return _rebuilt(kjt, values[keep], kept, weights[keep] if weights is not None else None), None

    def _inverse_limits(self, kjt: KeyedJaggedTensor) -> Optional[Tuple[torch.Tensor, torch.Tensor] | InputFault]:
        """A VBE batch's inverse indices and, per row, its feature's bag count (-1: a key this module does not read),
        for the range check on the device; or what is wrong with them on the host. TorchRec's EBC and EC expand
        each feature's bags by its row: without one, or with an index past the feature's bags, they fail on this
        rank alone after the all-to-alls (the EC asserts that VBE batches carry them)."""
        inverse = kjt.inverse_indices_or_none()
        if inverse is None:
            return InputFault(INVERSE_INDICES, numbers=(_NO_INVERSE, 0, 0))
        names, index = inverse
        if (
            not torch.is_tensor(index)
            or index.dtype not in ID_DTYPES
            or index.dim() != 2
            or index.size(0) != len(names)
        ):
            shape = list(index.shape) if torch.is_tensor(index) else []
            return InputFault(
                INVERSE_INDICES, numbers=(_INVERSE_TENSOR, len(names), len(shape)), shown=tuple(shape[:2])
            )
        row_of = {name: i for i, name in enumerate(names)}
        unread = [self._index[k] for k in kjt.keys() if k in self._index and k not in row_of]
        if unread:
            return InputFault(INVERSE_INDICES, unread[0], (_INVERSE_KEY, len(unread), 0))
        strides = dict(zip(kjt.keys(), kjt.stride_per_key()))
        limits = [strides[name] if name in self._index and name in strides else -1 for name in names]
        return index, torch.tensor(limits, device=index.device)

    def _inverse_outside(self, kjt: KeyedJaggedTensor, index: torch.Tensor, limits: torch.Tensor) -> InputFault:
        names = kjt.inverse_indices()[0]
        outside = _outside(index, limits)
        row = int(outside.any(dim=1).nonzero()[0])
        return InputFault(
            INVERSE_INDICES,
            self._index[names[row]],
            (_INVERSE_RANGE, int(outside.sum()), int(limits[row])),
            tuple(index[row][outside[row]][:_SHOWN].tolist()),
        )

    def _weighting(self, keys: List[str], kind: int) -> InputFault:
        """Weights where the module takes none, or none where it needs them: the module's features in the batch."""
        index = self._index
        return _naming(kind, [index[k] for k in dict.fromkeys(keys) if k in index])

    # the faults found on the device: worked out only on a bad batch, so their host syncs cost nothing otherwise

    def _negative_lengths(self, kjt: KeyedJaggedTensor) -> InputFault:
        keys = kjt.keys()
        negative = kjt.lengths() < 0
        strides = torch.tensor(kjt.stride_per_key(), device=negative.device)
        key_of_bag = torch.repeat_interleave(torch.arange(len(keys), device=negative.device), strides)
        first = keys[int(key_of_bag[negative][0])]
        return InputFault(NEGATIVE_LENGTH, self._index.get(first, -1), (int(negative.sum()), 0, 0))

    def _non_finite_weights(
        self, keys: List[str], per_key: List[int], weights: torch.Tensor, limit: torch.Tensor
    ) -> Optional[InputFault]:
        ours = limit >= 0
        nan, pos, neg = weights.isnan() & ours, weights.isposinf() & ours, weights.isneginf() & ours
        where = nan | pos | neg
        if not bool(where.any()):
            return None
        k = int(_key_of_ids(keys, per_key, weights.device)[where][0])
        return InputFault(NON_FINITE_WEIGHT, self._index[keys[k]], (int(nan.sum()), int(pos.sum()), int(neg.sum())))

    def _bad_ids(
        self, keys: List[str], per_key: List[int], values: torch.Tensor, bad: torch.Tensor, rows: torch.Tensor
    ) -> InputFault:
        key_of = _key_of_ids(keys, per_key, values.device)
        k = int(key_of[bad][0])
        shown = tuple(values[bad & (key_of == k)][:_SHOWN].tolist())
        return InputFault(BAD_ID, self._index[keys[k]], (int(bad.sum()), int(rows[k]), 0), shown)

    def describe(self, rank: int, fault: InputFault) -> str:
        """The fault of `rank`'s batch in words (the same text on every rank, which all decode the same record)."""
        a, b, c = fault.numbers
        feature = self._features[fault.feature] if 0 <= fault.feature < len(self._features) else None
        where = f"feature {feature!r} of table {self._feature_tables[feature]!r}" if feature else "a feature"
        if fault.kind == ID_DTYPE:
            what = (
                f"the KeyedJaggedTensor's IDs are {dtype_name(a)}; IDs must be integers "
                "(torch.int64 or torch.int32), as rows of their tables"
            )
        elif fault.kind == LENGTHS_DTYPE:
            what = f"the KeyedJaggedTensor's lengths are {dtype_name(a)}; they must be torch.int32 or torch.int64"
        elif fault.kind == WEIGHTS_DTYPE:
            what = (
                f"the KeyedJaggedTensor's weights are {dtype_name(a)}; per-sample weights must be torch.float32 or "
                "torch.float64"
            )
        elif fault.kind == MISSING:
            what = f"{self._named(fault)} are missing from the KeyedJaggedTensor"
        elif fault.kind == UNEXPECTED_WEIGHTS and self._collection == "EmbeddingBagCollection":
            what = (
                f"{self._named(fault)} of an unweighted EmbeddingBagCollection got per-sample weights; the module "
                "was built with is_weighted=False: send the KeyedJaggedTensor without weights, or build the module "
                "with is_weighted=True"
            )
        elif fault.kind == UNEXPECTED_WEIGHTS:
            what = (
                f"{self._named(fault)} got per-sample weights, but {self._collection} takes none (TorchRec's would "
                "drop them): send the KeyedJaggedTensor without weights"
            )
        elif fault.kind == NO_WEIGHTS:
            what = (
                f"{self._named(fault)} of a weighted {self._collection} got no per-sample weights; the module was "
                "built with is_weighted=True: give the KeyedJaggedTensor weights (1.0 where an ID is unweighted)"
            )
        elif fault.kind == COUNTS:
            weights = "" if c < 0 else f" and {c} weights"
            what = f"the bag lengths add up to {a} IDs, but the KeyedJaggedTensor holds {b} values{weights}"
        elif fault.kind == NEGATIVE_LENGTH:
            named = f" (first in feature {feature!r})" if feature else ""
            what = f"{a} negative bag lengths in the KeyedJaggedTensor{named}"
        elif fault.kind == NON_FINITE_WEIGHT:
            parts = [f"{n} {name}" for n, name in ((a, "NaN"), (b, "+Inf"), (c, "-Inf")) if n]
            what = f"{where} has non-finite per-sample weights ({', '.join(parts)} in this batch)"
        elif fault.kind == EMPTY_BATCH:
            what = (
                "the KeyedJaggedTensor holds no samples (batch size 0), for which TorchRec's EmbeddingCollection "
                "cannot build its output (construct_jagged_tensors views the lengths by the batch size), so this rank "
                "would fail after the all-to-alls while its peers wait: send at least one sample (empty bags are fine)"
            )
        elif fault.kind == VARIABLE_BATCH:
            what = (
                f"the KeyedJaggedTensor has a variable batch per feature (VBE), which TorchRec's data-parallel "
                f"sharding of {where} cannot expand; give every feature the same batch size"
            )
        elif fault.kind == BAD_ID:
            what = f"{where} has IDs {list(fault.shown)} outside [0, {b}) ({a} bad IDs in this batch)"
        elif fault.kind == NOT_A_KJT:
            instead = _INSTEAD[a] if 0 <= a < len(_INSTEAD) else _INSTEAD[0]
            what = f"the {self._collection} was given {instead}; it takes a KeyedJaggedTensor"
        elif fault.kind == SHAPE:
            dims = f"IDs {a}-D, lengths {b}-D" + ("" if c < 0 else f", weights {c}-D")
            what = f"the KeyedJaggedTensor's tensors must be 1-D, got {dims}"
        elif fault.kind == LENGTHS_COUNT and a < 0:
            what = "the KeyedJaggedTensor has neither lengths nor offsets"
        elif fault.kind == LENGTHS_COUNT:
            what = f"the KeyedJaggedTensor has {a} bag lengths, but its {c} keys and batch size (stride) make {b} bags"
        elif fault.kind == DUPLICATE_KEYS:
            what = (
                f"the KeyedJaggedTensor's keys give {self._named(fault)} twice (TorchRec would read only one of them)"
            )
        elif fault.kind == INVERSE_INDICES:
            what = self._describe_inverse(fault, where)
        else:
            what = f"its input check failed with an unknown code {fault.kind}"
        return f"rank {rank}: {what}"

    def _describe_inverse(self, fault: InputFault, where: str) -> str:
        code, n, bound = fault.numbers
        if code == _NO_INVERSE:
            return (
                "the KeyedJaggedTensor has a variable batch per feature (VBE) but no inverse indices, which the "
                f"{self._collection} needs to expand each feature's bags to the batch"
            )
        if code == _INVERSE_TENSOR:
            shape = list(fault.shown)
            return (
                "the KeyedJaggedTensor's inverse indices are no integer tensor with one row for each of their "
                f"{n} keys (got {bound}-D{f' of shape {shape}' if shape else ''})"
            )
        if code == _INVERSE_KEY:
            more = f" (and {n - 1} more features)" if n > 1 else ""
            return f"{where} has no row in the KeyedJaggedTensor's inverse indices{more}"
        return f"{where} has inverse indices {list(fault.shown)} outside its [0, {bound}) bags ({n} in this batch)"

    def _named(self, fault: InputFault) -> str:
        """The features a fault lists (how many, the first few): "feature 'a'" or "features ['a', 'b'] and 3 more"."""
        names = [self._features[i] for i in fault.shown]
        if fault.numbers[0] == 1 and names and fault.kind != MISSING:
            return f"feature {names[0]!r}"
        more = f" and {fault.numbers[0] - len(names)} more" if fault.numbers[0] > len(names) else ""
        return f"features {names}{more}"

    def error(self, faults: Dict[int, InputFault]) -> InvalidInputError:
        """The error every rank raises for the ranks' faults (by rank): each bad rank's fault, in rank order; an
        InvalidIdError when the first is an ID out of range."""
        first = faults[min(faults)]
        cls = InvalidIdError if first.kind == BAD_ID else InvalidInputError
        text = "; ".join(self.describe(r, faults[r]) for r in sorted(faults))
        return cls(f"{text} (every rank refuses this batch, before its input all-to-all)")


def _naming(kind: int, features: List[int]) -> InputFault:
    """A fault that names features (indices into the module's): how many, and the first few."""
    return InputFault(kind, numbers=(len(features), 0, 0), shown=tuple(features[:_SHOWN]))


def _bounds(
    rows: torch.Tensor, per_key: List[int], values: torch.Tensor, total: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each ID's table rows (-1: a key this module does not read), and which IDs lie outside [0, rows)."""
    limit = rows.repeat_interleave(torch.tensor(per_key, device=values.device), output_size=total)
    return limit, (limit >= 0) & ((values < 0) | (values >= limit))


def _outside(index: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """Which inverse indices lie outside their row's [0, limit) (rows of limit -1 are not checked)."""
    limit = limits.unsqueeze(1)
    return (limit >= 0) & ((index < 0) | (index >= limit))


def _key_of_ids(keys: List[str], per_key: List[int], device: torch.device) -> torch.Tensor:
    """Each ID's key (an index into `keys`), from the IDs per key."""
    return torch.repeat_interleave(torch.arange(len(keys), device=device), torch.tensor(per_key, device=device))


def _rebuilt(
    kjt: KeyedJaggedTensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    inverse_indices: Tuple[List[str], torch.Tensor] | None = None,
) -> KeyedJaggedTensor:
    """`kjt` with new values, lengths and weights (and inverse indices, where given), keeping its batch layout (also
    a variable batch per feature)."""
    if kjt.variable_stride_per_key():
        return KeyedJaggedTensor(
            keys=kjt.keys(),
            values=values,
            lengths=lengths,
            weights=weights,
            stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
            inverse_indices=inverse_indices or kjt.inverse_indices_or_none(),
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
