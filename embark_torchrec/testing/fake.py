"""A single-process stand-in for a large world, on torch's "fake" process group, for plan and layout checks.

Why: the planner and the sharders only need a process group of the right size to build plans and sharded modules,
so up to 128 (or more) ranks can be simulated from one process in well under a second.

Limits: collectives do not communicate (they return without moving data), so results that depend on other ranks are
wrong. Forward passes of sharded modules segfault and DistributedModelParallel on rank != 0 dies in DDP init, so use
it for plans and shard layouts only (e.g. ``sharded_ebc._embedding_shardings[i]._grouped_embedding_configs_per_rank``;
sharded-state initialisation is skipped). RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are set process-wide for
the duration of the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers the "fake" backend

from embark_torchrec.testing._env import check_world, patched_environ, rank_env

__all__ = ["fake_world"]


@contextmanager
def fake_world(world_size: int, rank: int = 0, local_world_size: int | None = None) -> Iterator[dist.ProcessGroup]:
    """Initialise a fake default process group of ``world_size`` ranks seen from ``rank``; yield it, then destroy it."""
    lws = check_world(world_size, local_world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("fake_world needs no default process group to be initialised already")
    with patched_environ(rank_env(rank, world_size, lws)):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            group = dist.group.WORLD
            assert group is not None
            yield group
        finally:
            dist.destroy_process_group()
