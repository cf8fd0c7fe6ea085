"""Count the host work of a piece of code: ops dispatched, device->host syncs and blocking collectives.

Why count instead of time: on a GPU the host launches kernels ahead of the device, so a step is fast only if its
host work is small (few ops, independent of the number of tables) and never waits on the device (a host sync) or on
the network (a collective without ``async_op=True``). Both stalls are invisible on CPU, where every op runs
synchronously anyway, so on CPU we count the calls that would stall instead:

* every op that reaches the dispatcher, by overload name (``ops``; ``aten_ops`` sums the aten ones);
* host syncs (``sync_ops``): ops whose output size or value the host must read (``item()`` and friends, ``nonzero``,
  ``masked_select``, ``unique*``, ``bincount``, ``repeat_interleave`` without ``output_size``, indexing with a bool
  mask), device->host copies that are not ``non_blocking``, and ``Tensor.tolist()``, which on CPU bypasses the
  dispatcher and is therefore counted by patching it;
* collectives of ``torch.distributed`` (``collective_ops``), and those called without ``async_op=True``
  (``blocking_ops``), counted by patching them on ``torch.distributed`` and ``torch.distributed.distributed_c10d``
  (TorchRec calls them as ``dist.all_to_all_single(...)``).

Reads of tensors that live on the host by construction, also in a CUDA run, are no device syncs and are counted
apart (``host_metadata_reads``): fbgemm builds its variable-batch metadata on ``device="cpu"``
(``generate_vbe_metadata``), and TorchRec's KeyedJaggedTensor keeps its per-rank strides as a CPU tensor. On a CPU
run they cannot be told apart by device, so they are recognised by the function reading them (HOST_METADATA_SITES).

Limits: the dispatch mode sees only the current thread's ops (autograd runs CPU backward in the calling thread);
the patches are process-wide, so collectives and ``tolist`` of other threads are counted too. ``Tensor.numpy()``
and work inside C++ kernels (e.g. an fbgemm op that syncs internally) are not seen.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections import Counter
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COLLECTIVES", "EXCHANGE_COLLECTIVES", "HostWorkCounter"]

#: The torch.distributed collectives whose output on a rank is made of what its peers send (all-to-all, all-gather,
#: reduce-scatter): what a fake world must mirror for its dists' metadata to agree (benchmarks/gpu_check.py).
EXCHANGE_COLLECTIVES = (
    "all_to_all_single",
    "all_to_all",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_gather_into_tensor",
    "all_gather",
)
#: The torch.distributed collectives counted; send and recv always block (isend/irecv are their async forms).
COLLECTIVES = (*EXCHANGE_COLLECTIVES, "all_reduce", "broadcast", "send", "recv")

#: (file name, function) of the frames that read host-resident metadata tensors (see the module docstring)
HOST_METADATA_SITES = frozenset(
    {
        ("split_table_batched_embeddings_ops_training_common.py", "generate_vbe_metadata"),
        ("jagged_tensor.py", "stride_per_key_per_rank"),
        ("jagged_tensor.py", "_maybe_compute_stride_per_key"),
        ("jagged_tensor.py", "_maybe_compute_stride_kjt"),
    }
)


def _reads_host_metadata() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if (code.co_filename.rsplit("/", 1)[-1], code.co_name) in HOST_METADATA_SITES:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


_aten = torch.ops.aten
# ops whose output size or value depends on device data, so the host waits for the device
_ALWAYS_SYNC = {
    _aten._local_scalar_dense,  # item(), int(t), float(t), bool(t)
    _aten.nonzero,
    _aten.masked_select,
    _aten._unique,
    _aten._unique2,
    _aten.unique_dim,
    _aten.unique_consecutive,
    _aten.unique_dim_consecutive,
    _aten.bincount,
    _aten.equal,  # returns a host bool
}
_BOOL_INDEXED = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
_MASK_DTYPES = (torch.bool, torch.uint8)
_HOST = torch.device("cpu")
_MISSING = object()  # a patched attribute that was inherited, not set on the class


def _is_sync(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    packet = func.overloadpacket
    if packet in _ALWAYS_SYNC:
        return True
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if packet in _BOOL_INDEXED:
        return any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in args[1])
    if func is _aten._to_copy.default:  # t.to("cpu") / t.cpu() of a device tensor
        target = kwargs.get("device")
        return (
            args[0].device.type != "cpu"
            and target is not None
            and torch.device(target) == _HOST
            and not kwargs.get("non_blocking", False)
        )
    if packet is _aten.copy_:  # host_tensor.copy_(device_tensor)
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return dst.device.type == "cpu" and src.device.type != "cpu" and blocking
    return False


def _async_position(fn: Callable[..., Any]) -> int | None:
    """Position of the ``async_op`` parameter, or None if the collective has none (it always blocks)."""
    names = list(inspect.signature(fn).parameters)
    return names.index("async_op") if "async_op" in names else None


class HostWorkCounter(TorchDispatchMode):
    """While active, counts ops, host syncs and (blocking) collectives; see the module docstring.

    Use as ``with HostWorkCounter() as counter: step()``, then read ``counter.summary()`` (picklable, for run_ranks).
    Counters may nest (each counts everything inside it); patches are restored on exit, exceptions included.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.sync_ops: Counter[str] = Counter()
        self.host_metadata_ops: Counter[str] = Counter()
        self.collective_ops: Counter[str] = Counter()
        self.blocking_ops: Counter[str] = Counter()
        self._patches: list[list[tuple[Any, str, Any]]] = []  # one list of (owner, name, saved) per __enter__
        self._inside = threading.local()  # a collective implemented by another counts once

    @property
    def aten_ops(self) -> int:
        return sum(n for name, n in self.ops.items() if name.startswith("aten."))

    @property
    def host_syncs(self) -> int:
        return sum(self.sync_ops.values())

    @property
    def host_metadata_reads(self) -> int:
        return sum(self.host_metadata_ops.values())

    @property
    def collectives(self) -> int:
        return sum(self.collective_ops.values())

    @property
    def blocking_collectives(self) -> int:
        return sum(self.blocking_ops.values())

    def summary(self) -> dict[str, Any]:
        """The four totals, plus which ops synced and which collectives blocked, as plain dicts."""
        return {
            "aten_ops": self.aten_ops,
            "host_syncs": self.host_syncs,
            "host_metadata_reads": self.host_metadata_reads,
            "collectives": self.collectives,
            "blocking_collectives": self.blocking_collectives,
            "sync_ops": dict(self.sync_ops),
            "host_metadata_ops": dict(self.host_metadata_ops),
            "blocking_ops": dict(self.blocking_ops),
        }

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        self.ops[name] += 1
        if _is_sync(func, args, kwargs):
            (self.host_metadata_ops if _reads_host_metadata() else self.sync_ops)[name] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> "HostWorkCounter":
        patches: list[tuple[Any, str, Any]] = []
        self._patches.append(patches)
        try:
            for module in (dist, c10d):
                for name in COLLECTIVES:
                    self._patch(patches, module, name, self._counted_collective(name, getattr(module, name)))
            self._patch(patches, torch.Tensor, "tolist", self._counted_tolist(torch.Tensor.tolist))
            super().__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._restore()

    @staticmethod
    def _patch(patches: list[tuple[Any, str, Any]], owner: ModuleType | type, name: str, new: Any) -> None:
        patches.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, new)

    def _restore(self) -> None:
        for owner, name, saved in reversed(self._patches.pop()):
            if saved is _MISSING:
                delattr(owner, name)  # it was inherited (Tensor.tolist lives on TensorBase)
            else:
                setattr(owner, name, saved)

    def _counted_collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        position = _async_position(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "active", False):
                return fn(*args, **kwargs)
            is_async = False
            if position is not None:
                is_async = bool(args[position] if len(args) > position else kwargs.get("async_op", False))
            self.collective_ops[name] += 1
            if not is_async:
                self.blocking_ops[name] += 1
            self._inside.active = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.active = False

        return call

    def _counted_tolist(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def tolist(tensor: torch.Tensor) -> Any:
            (self.host_metadata_ops if _reads_host_metadata() else self.sync_ops)["Tensor.tolist"] += 1
            return fn(tensor)

        return tolist
