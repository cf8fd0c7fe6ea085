"""One split exchange per sharded module and batch, carrying every rank's input check: a bad batch on any rank is
every rank's error, raised before any rank starts an all-to-all that could not complete.

TorchRec's KJTAllToAll first exchanges split sizes (bags, IDs and weights for each peer, and the batch size), then
the tensors. A rank whose batch fails the input check (validation.py) cannot send its tensors; if it raised alone,
its peers would wait in the tensors' all-to-all until the process group's timeout (or fail with "Connection closed
by peer" once it died). So each KJTAllToAll of our sharded modules only records what it would send
(`DeferredKJTAllToAll` returns TorchRec's KJTSplitsAllToAllMeta, as TrainPipelineSparseDist's own forward does), and
the module sends every sharding's split sizes in one all-to-all (`SplitsExchange`), with its rank's `InputFault`
record (all zeros for a good batch) and a layout code per sharding (weights or not, a variable batch or not). When
the splits arrive every rank reads every rank's record: if any rank's batch is bad, all raise the same error, naming
each bad rank, its feature and what is wrong, before any tensor all-to-all starts; ranks whose batches differ in
layout, which TorchRec's all-to-alls would hang or crash on, are refused the same way. A bad rank sends only the
exchange. Each rank issued the same one collective for the batch, so a rank that catches the error and goes on
(e.g. skips the batch) stays in step with the others.

Collectives: TorchRec sends one split exchange per sharding with a KJT all-to-all (under TrainPipelineSparseDist, one
per process group for all pipelined modules); this sends one per module instead. A module whose every table is
data-parallel had none and gets this one (a few integers per rank, asynchronous): without it a bad batch could not
reach the other ranks before their DDP all-reduce. Its size per peer is plan/layout/wire.py's split_exchange_bytes; with
counting on (comm_stats), each exchange's tensors are counted as "metadata".
"""

from __future__ import annotations

import abc
import functools
from typing import Any, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, KJTAllToAllTensorsAwaitable
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable, KJTSplitsAllToAllMeta
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..plan.layout.wire import SPLIT_ROWS, split_exchange_ints
from .comm_stats import CommStats, SplitsExchangeCounter
from .torchrec_compat import (
    collective_group,
    input_dist_all_to_all,
    kjt_splits,
    kjt_stagger,
    module_device,
    module_env,
    split_meta_input,
)
from .validation import OK, InputFault, InputValidator, InvalidInputError, dtype_code, dtype_name, not_a_kjt

_BLOCK = 1 + SPLIT_ROWS  # per sharding: its layout code, then its split rows (plan/layout/wire.py)
_NO_KJT = 0  # the layout code of a sharding without a KJT all-to-all (data-parallel), or of a bad rank's blank


class DeferredKJTAllToAll:
    """A KJTAllToAll's forward that sends nothing: it returns what the all-to-all would send (TorchRec's
    KJTSplitsAllToAllMeta, without split tensors) for the module's SplitsExchange."""

    def __init__(self, a2a: KJTAllToAll) -> None:
        self._pg = collective_group(a2a)
        self._splits = kjt_splits(a2a)
        self._stagger = kjt_stagger(a2a)
        rank = dist.get_rank(self._pg)
        self._local = slice(sum(self._splits[:rank]), sum(self._splits[: rank + 1]))

    def __call__(self, input: KeyedJaggedTensor) -> KJTSplitsAllToAllMeta:
        with torch.no_grad():
            return KJTSplitsAllToAllMeta(
                pg=self._pg,
                _input=input,
                splits=self._splits,
                splits_tensors=[],
                input_splits=input.dist_splits(self._splits),
                input_tensors=input.dist_tensors(),
                labels=input.dist_labels(),
                keys=input.keys()[self._local],
                device=input.values().device,
                stagger=self._stagger,
            )


def defer_kjt_all_to_alls(input_dists: Sequence[torch.nn.Module]) -> None:
    """Makes each input dist's KJTAllToAll a DeferredKJTAllToAll (TrainPipelineSparseDist puts its own forward,
    which also only records, in its place while it runs, and ours back after)."""
    for input_dist in input_dists:
        a2a = input_dist_all_to_all(input_dist)
        if a2a is not None:
            a2a.forward = DeferredKJTAllToAll(a2a)


def _layout(meta: KJTSplitsAllToAllMeta) -> int:
    """1 + weights + 2 x variable batch: what decides the split rows and the tensors a KJT all-to-all sends."""
    return 1 + ("weights" in meta.labels) + 2 * split_meta_input(meta).variable_stride_per_key()


def _describe_layout(code: int) -> str:
    if code == _NO_KJT:
        return "no KJT"
    weights = "with weights" if (code - 1) & 1 else "without weights"
    return f"{weights}, {'a variable batch per feature' if (code - 1) & 2 else 'one batch size'}"


_DTYPE_BITS = 5  # a dtype's code (validation.dtype_code) + 1, three of them in a batch's dtypes code


def _dtypes_code(kjt: KeyedJaggedTensor) -> int:
    """The batch's IDs', lengths' and weights' dtypes as one integer (0 for no weights), which every rank must send
    alike: int32 IDs on one rank among int64 ones make the all-to-alls exchange tensors of two sizes (gloo aborts the
    process, or waits forever), as do float16 weights among float32 ones."""
    weights = kjt.weights_or_none()
    return _code_of_dtypes(kjt.values().dtype, kjt.lengths().dtype, None if weights is None else weights.dtype)


@functools.lru_cache(maxsize=None)  # a few dtypes: worked out once each, not per batch
def _code_of_dtypes(ids: torch.dtype, lengths: torch.dtype, weights: Optional[torch.dtype]) -> int:
    codes = (dtype_code(ids), dtype_code(lengths), dtype_code(weights) if weights is not None else -1)
    return sum((c + 1) << (_DTYPE_BITS * i) for i, c in enumerate(codes))


def _describe_dtypes(code: int) -> str:
    codes = [((code >> (_DTYPE_BITS * i)) & ((1 << _DTYPE_BITS) - 1)) - 1 for i in range(3)]
    named = [f"{what} {dtype_name(c)}" for what, c in zip(("IDs", "lengths", "weights"), codes) if c >= 0]
    return ", ".join(named) + ("" if codes[2] >= 0 else ", no weights")


def _rows(meta: KJTSplitsAllToAllMeta, world: int) -> List[List[int]]:
    """The split rows a KJT all-to-all exchanges: one per tensor it sends, then the batch size (when uniform)."""
    kjt = split_meta_input(meta)
    return list(meta.input_splits) + ([] if kjt.variable_stride_per_key() else [[kjt.stride()] * world])


class SplitsExchange:
    """One batch's split exchange for a module: started when built (asynchronously), read once by the first of
    its shardings' ExchangedSplits to be waited, which raises the batch's error on every rank."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        pending: Sequence[Any],
        fault: Optional[InputFault],
        validator: InputValidator,
        sharding_types: Sequence[str],
        device: torch.device,
        counter: Optional[SplitsExchangeCounter] = None,
    ) -> None:
        world = pg.size()
        self._validator, self._sharding_types = validator, list(sharding_types)
        self._rows: List[int] = []
        sent = np.zeros((world, split_exchange_ints(len(pending))), dtype=np.int64)
        for i, p in enumerate(pending):
            rows: List[List[int]] = []
            if isinstance(p, KJTSplitsAllToAllMeta):
                if p.pg is not pg:
                    raise RuntimeError(
                        f"sharding {self._sharding_types[i]!r} sends its KJT on another process group than its module"
                    )
                rows = _rows(p, world)
                sent[:, i * _BLOCK] = _layout(p)
                sent[:, i * _BLOCK + 1 : i * _BLOCK + 1 + len(rows)] = np.asarray(rows, dtype=np.int64).T
            self._rows.append(len(rows))
        sent[:, len(pending) * _BLOCK :] = (fault or InputFault(OK)).to_ints()
        self._codes = sent[0, : len(pending) * _BLOCK : _BLOCK]
        self._sent = torch.from_numpy(sent).to(device)
        if world > 1:
            self._received = torch.empty_like(self._sent)
            self._work: Optional[dist.Work] = dist.all_to_all_single(
                self._received, self._sent, group=pg, async_op=True
            )
            if counter is not None:
                counter(self._sent, self._received)
        else:
            self._received, self._work = self._sent, None
        self._splits: Optional[np.ndarray] = None
        self._error: Optional[InvalidInputError] = None

    def splits(self, index: int) -> List[List[int]]:
        """Sharding `index`'s split rows as received, one list over the senders per row; raises every rank's
        input fault, or a difference in layout between the ranks' batches."""
        if self._splits is None and self._error is None:
            if self._work is not None:
                self._work.wait()
            received = np.asarray(self._received.tolist(), dtype=np.int64)  # the one host read, as TorchRec's
            self._error = self._check(received)
            self._splits = received
        if self._error is not None:
            raise self._error
        assert self._splits is not None
        start = index * _BLOCK + 1
        return self._splits[:, start : start + self._rows[index]].T.tolist()

    def _check(self, received: np.ndarray) -> Optional[InvalidInputError]:
        """Every rank's fault, else a difference in dtypes or layout between the ranks; a good batch costs three
        array comparisons, whatever the ranks and shardings (the per-rank and per-sharding loops name a bad one)."""
        records = received[:, -InputFault.FIELDS :]
        if (records[:, 0] != OK).any():
            return self._validator.error(
                {r: InputFault.from_ints(row.tolist()) for r, row in enumerate(records) if row[0] != OK}
            )
        dtypes = records[:, 2]  # a good batch's record carries its dtypes (CheckedInput.exchange_splits)
        if (dtypes != dtypes[0]).any():
            said = ", ".join(f"rank {r}: {_describe_dtypes(int(c))}" for r, c in enumerate(dtypes))
            return InvalidInputError(
                f"the ranks' KeyedJaggedTensors differ in dtypes ({said}); every rank must send IDs, lengths and "
                "weights of the same dtypes (every rank refuses this batch, before its input all-to-all)"
            )
        if (received[:, : len(self._codes) * _BLOCK : _BLOCK] != self._codes).any():
            i = next(i for i, mine in enumerate(self._codes) if (received[:, i * _BLOCK] != mine).any())
            layouts = ", ".join(f"rank {r}: {_describe_layout(int(c))}" for r, c in enumerate(received[:, i * _BLOCK]))
            return InvalidInputError(
                f"the ranks' KeyedJaggedTensors differ in layout for sharding {self._sharding_types[i]!r} "
                f"({layouts}); every rank must send weights alike and a variable batch per feature alike "
                "(every rank refuses this batch, before its input all-to-all)"
            )
        return None


class ExchangedSplits(Awaitable[Any]):
    """A sharding's first wait: its split sizes from the module's exchange (which raises the batch's error on every
    rank), then TorchRec's tensor all-to-all, started as TorchRec's own split exchange starts it; a sharding without
    a KJT all-to-all (data-parallel) waits its own awaitable."""

    def __init__(self, exchange: SplitsExchange, index: int, pending: Any) -> None:
        super().__init__()
        self._exchange, self._index, self._pending = exchange, index, pending

    def _wait_impl(self) -> Any:
        splits = self._exchange.splits(self._index)
        meta = self._pending
        if not isinstance(meta, KJTSplitsAllToAllMeta):
            assert meta is not None, "a bad rank's blank sharding got through its exchange"
            return meta.wait()  # data-parallel: its NoWait
        variable = split_meta_input(meta).variable_stride_per_key()
        return KJTAllToAllTensorsAwaitable(
            pg=meta.pg,
            input=split_meta_input(meta),
            splits=meta.splits,
            input_splits=meta.input_splits,
            output_splits=splits if variable else splits[:-1],
            input_tensors=meta.input_tensors,
            labels=meta.labels,
            keys=meta.keys,
            device=meta.device,
            stagger=meta.stagger,
            stride_per_rank=None if variable else splits[-1],
        )


class CheckedInput(metaclass=abc.ABCMeta):
    """The door of our sharded EBC and EC and of the managed-collision modules, mixed in before TorchRec's sharded
    module: `input_dist` checks the batch (`check_input`), then turns TorchRec's input dist's request into one that
    waits the module's split exchange first (`exchange_splits`), counted when the module counts its bytes
    (`comm_stats`)."""

    _validate: InputValidator
    comm_stats: Optional[CommStats]
    _exchange_counter: Optional[SplitsExchangeCounter] = None
    _batch_dtypes = 0  # the last checked batch's dtypes (_dtypes_code), which its exchange carries

    @abc.abstractmethod
    def embedding_sharding_types(self) -> List[str]:
        """The sharding-type strings of the module's shardings, in its input dists' order (which the exchange's
        errors name)."""

    def input_dist(self, ctx: Any, features: Any) -> KJTListSplitsAwaitable:
        """The batch checked, then TorchRec's input dist, whose request waits the module's split exchange first
        (which raises a bad batch's error on every rank); a bad batch only takes part in the exchange."""
        features, fault = self.check_input(features)
        request = None
        if fault is None:
            request = super().input_dist(ctx, features)  # type: ignore[misc]
            self._after_input_dist(ctx)
        pg = module_env(self).process_group
        return self.exchange_splits(ctx, request, fault, pg, self.embedding_sharding_types(), module_device(self))

    def _after_input_dist(self, ctx: Any) -> None:
        """TorchRec's input dist has run on a good batch, whose request is not sent yet: a module whose input dists
        cut state from the batch files it in the batch's context here (EmbarkShardedModule); the managed collisions
        cut none."""

    def check_input(self, features: Any) -> tuple[Any, Optional[InputFault]]:
        if isinstance(features, KeyedJaggedTensor):
            checked, fault = self._validate.check(features)
            # after the check: a batch without lengths (or offsets) has no lengths' dtype, and is a fault already
            self._batch_dtypes = _dtypes_code(checked) if fault is None else 0
            return checked, fault
        return features, not_a_kjt(features)

    def exchange_splits(
        self,
        ctx: Any,
        request: Optional[KJTListSplitsAwaitable],
        fault: Optional[InputFault],
        pg: dist.ProcessGroup,
        sharding_types: Sequence[str],
        device: torch.device,
    ) -> KJTListSplitsAwaitable:
        """`request` (TorchRec's, of the input dists' pending all-to-alls), or for a bad batch (`fault`, no request)
        one of blank shardings, waiting the exchange first."""
        pending = list(request.awaitables) if request is not None else [None] * len(sharding_types)
        counter = None
        if self.comm_stats is not None:
            if self._exchange_counter is None:
                self._exchange_counter = SplitsExchangeCounter(self.comm_stats, pg)
            counter = self._exchange_counter
        record = fault or InputFault(OK, numbers=(self._batch_dtypes, 0, 0))
        exchange = SplitsExchange(pg, pending, record, self._validate, sharding_types, device, counter)
        if request is None:
            request = KJTListSplitsAwaitable([], ctx)
        request.awaitables = [ExchangedSplits(exchange, i, p) for i, p in enumerate(pending)]
        return request
