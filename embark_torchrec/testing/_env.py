"""Environment variables that describe a rank's place in the simulated cluster (read by TorchRec's comm helpers)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


def check_world(world_size: int, local_world_size: int | None) -> int:
    """Validates the world shape and returns the local world size (default: one node holding every rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    lws = world_size if local_world_size is None else local_world_size
    if lws < 1 or world_size % lws != 0:
        raise ValueError(f"local_world_size {lws} must be >= 1 and divide world_size {world_size}")
    return lws


def rank_env(rank: int, world_size: int, local_world_size: int) -> dict[str, str]:
    """The torchrun-style variables for one rank: ranks fill node 0 first, so rank r is on node r // local_size."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(rank // local_world_size),
    }


@contextmanager
def patched_environ(updates: Mapping[str, str], remove: tuple[str, ...] = ()) -> Iterator[None]:
    """Sets/removes variables for the duration and restores the previous values, since os.environ is process-wide."""
    keys = set(updates) | set(remove)
    saved = {key: os.environ.get(key) for key in keys}
    try:
        for key in remove:
            os.environ.pop(key, None)
        os.environ.update(updates)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
