"""The host work of one training step, counted as both host-work suites count it (bags and sequences)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.testing import global_kjt_batch
from embark_torchrec.testing.host_work import HostWorkCounter


def second_step_work(
    model: torch.nn.Module,
    tables: Sequence[BaseEmbeddingConfig],
    world_size: int,
    batch: int,
    step: Callable[[torch.nn.Module, KeyedJaggedTensor], None],
) -> dict[str, Any]:
    """HostWorkCounter's summary of `step` on this rank's slice of the second of two global batches: the first step,
    not counted, builds the dists TorchRec and we create lazily."""
    first, second = (global_kjt_batch(tables, world_size, batch, seed=s)[dist.get_rank()] for s in range(2))
    step(model, first)
    with HostWorkCounter() as counter:
        step(model, second)
    return counter.summary()


def show(summary: dict[str, Any]) -> str:
    """One summary's ops, syncs and blocking collectives, for an assertion's message."""
    return (
        f"{summary['aten_ops']} aten ops, {summary['host_syncs']} syncs {summary['sync_ops']}, "
        f"blocking {summary['blocking_ops']}"
    )
