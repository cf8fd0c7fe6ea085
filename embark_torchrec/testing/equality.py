"""Check a sharded model against an unsharded copy: same weights in, same outputs out, compared key by key.

Why per key: sharded and unsharded modules may order the keys of their KeyedTensor outputs differently (outputs are
grouped by sharding type), so comparing the flat values would report false mismatches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedTensor

__all__ = ["assert_keyed_close", "assert_matches_unsharded", "copy_global_weights"]


def _global_state(source: nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    return source.state_dict() if isinstance(source, nn.Module) else source


@torch.no_grad()
def copy_global_weights(sharded: nn.Module, source: nn.Module | Mapping[str, torch.Tensor]) -> list[str]:
    """Copy the unsharded ``source`` weights into ``sharded`` (e.g. a DistributedModelParallel), shard by shard.

    Each local shard of a ShardedTensor receives the slice of the global tensor at its ``shard_offsets``; plain
    tensors (replicated or data-parallel) are copied whole. Writes go through ``sharded.state_dict()``, whose
    tensors are views of the live weights (fused kernels included). Every key of the sharded state must exist in
    ``source`` with the global shape. Returns the keys copied.
    """
    state = _global_state(source)
    copied: list[str] = []
    for key, target in sharded.state_dict().items():
        if key not in state:
            raise KeyError(f"{key!r} of the sharded model is missing from the global weights (have {sorted(state)})")
        value = state[key]
        if isinstance(target, ShardedTensor):
            if tuple(target.size()) != tuple(value.shape):
                raise ValueError(f"{key!r}: sharded global shape {tuple(target.size())} != source {tuple(value.shape)}")
            for shard in target.local_shards():
                region = value
                offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
                    region = region.narrow(dim, offset, size)
                shard.tensor.copy_(region.to(shard.tensor.device, shard.tensor.dtype))
        elif isinstance(target, torch.Tensor) and type(target) in (torch.Tensor, nn.Parameter):
            if target.shape != value.shape:
                raise ValueError(f"{key!r}: shape {tuple(target.shape)} != source {tuple(value.shape)}")
            target.copy_(value.to(target.device, target.dtype))
        else:
            raise TypeError(f"{key!r}: cannot copy into a {type(target).__name__} (ShardedTensor or Tensor expected)")
        copied.append(key)
    return copied


def _as_dict(output: Any) -> dict[str, torch.Tensor]:
    if isinstance(output, Awaitable):  # sharded modules return (lazy) awaitables
        output = output.wait()
    if isinstance(output, KeyedTensor):
        return output.to_dict()
    if isinstance(output, Mapping) and all(isinstance(v, torch.Tensor) for v in output.values()):
        return dict(output)
    raise TypeError(f"expected a KeyedTensor or a dict of tensors, got {type(output).__name__}")


def _naming(key: str) -> Callable[[str], str]:
    return lambda message: f"key {key!r}: {message}"


def assert_keyed_close(actual: Any, expected: Any, atol: float = 1e-5, rtol: float = 1e-5) -> dict[str, float]:
    """Assert two KeyedTensors (or dicts of tensors) have the same keys and close values per key.

    Returns the largest absolute difference per key, so callers can report or assert on it.
    """
    got, want = _as_dict(actual), _as_dict(expected)
    if set(got) != set(want):
        raise AssertionError(f"keys differ: got {sorted(got)}, expected {sorted(want)}")
    max_diff: dict[str, float] = {}
    for key in sorted(want):
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=rtol, msg=_naming(key))
        delta = (got[key].detach().double() - want[key].detach().double()).abs()
        max_diff[key] = float(delta.max()) if delta.numel() else 0.0
    return max_diff


@torch.no_grad()
def assert_matches_unsharded(
    sharded: nn.Module, unsharded: nn.Module, features: Any, atol: float = 1e-5, rtol: float = 1e-5
) -> dict[str, float]:
    """Run both models on the same input and compare their outputs per key (see ``assert_keyed_close``).

    Feed each rank its own slice of the global batch and compare with the unsharded model on that slice.
    """
    return assert_keyed_close(sharded(features), unsharded(features), atol=atol, rtol=rtol)
