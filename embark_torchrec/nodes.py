"""Simulated nodes: several "nodes" of ranks on one machine, for hierarchical plans on a box of CPUs."""

from __future__ import annotations

import os

import torch.distributed as dist


def simulate_nodes(local_world_size: int) -> None:
    """Regroup this job's ranks (as torchrun numbers them, RANK and WORLD_SIZE in the environment)
    into nodes of `local_world_size`: sets LOCAL_WORLD_SIZE, LOCAL_RANK and GROUP_RANK, which
    TorchRec and our planner read for their intra- and cross-node groups. Call it before
    init_process_group; pick the rank's device from the real LOCAL_RANK before calling it."""
    if dist.is_initialized():
        raise RuntimeError("simulate_nodes must run before torch.distributed.init_process_group")
    missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise RuntimeError(f"simulate_nodes needs {missing} in the environment: start the job with torchrun")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"local world size {local_world_size} does not divide world size {world_size}")
    os.environ.update(
        LOCAL_WORLD_SIZE=str(local_world_size),
        LOCAL_RANK=str(rank % local_world_size),
        GROUP_RANK=str(rank // local_world_size),
    )
