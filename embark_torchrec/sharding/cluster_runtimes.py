"""The runtime side of each cluster kind: the EmbeddingSharding of ours that runs a sharding group of it inside DMP.

A runtime registers against a plan-side kind's class (plan/layout/kinds.py), and a subclass of a kind runs on its
base's runtime unless it registers its own: a new kind that only prices differently needs no runtime code. The
data-parallel kind has none of ours (TorchRec's data-parallel sharding runs it), so asking for it names the kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol

import torch
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv

from ..plan.layout.kinds import ClusterKind, ReductionKind, UniqueKind
from .grid import GridPooledEmbeddingSharding
from .sequence import GridSequenceEmbeddingSharding, UniqueSequenceEmbeddingSharding
from .unique import UniquePooledEmbeddingSharding


class ShardingFactory(Protocol):
    def __call__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device],
        codecs: Optional[Dict[str, QuantizedCommCodecs]],
        hierarchical: bool,
    ) -> EmbeddingSharding: ...


@dataclass(frozen=True)
class ClusterRuntime:
    """How one kind's sharding group is built: for pooled tables (an EmbeddingBagCollection's) and for sequence
    tables (an EmbeddingCollection's, which never reduces hierarchically)."""

    pooled: ShardingFactory
    sequence: ShardingFactory


_RUNTIMES: dict[type[ClusterKind], ClusterRuntime] = {}


def register_cluster_runtime(kind: type[ClusterKind], runtime: ClusterRuntime) -> None:
    """Runs `kind`'s groups, and its subclasses' that register none of their own, with `runtime`."""
    _RUNTIMES[kind] = runtime


def cluster_runtime(kind: ClusterKind) -> ClusterRuntime:
    """The runtime registered for the kind's class or its nearest base."""
    for cls in type(kind).__mro__:
        if cls in _RUNTIMES:
            return _RUNTIMES[cls]
    raise KeyError(f"cluster kind {kind.name!r} has no runtime of ours registered (register_cluster_runtime)")


register_cluster_runtime(
    ReductionKind,
    ClusterRuntime(
        pooled=lambda infos, env, device, codecs, hierarchical: GridPooledEmbeddingSharding(
            infos, env, device, qcomm_codecs_registry=codecs, hierarchical=hierarchical
        ),
        sequence=lambda infos, env, device, codecs, hierarchical: GridSequenceEmbeddingSharding(
            infos, env, device, qcomm_codecs_registry=codecs
        ),
    ),
)
register_cluster_runtime(
    UniqueKind,
    ClusterRuntime(
        pooled=lambda infos, env, device, codecs, hierarchical: UniquePooledEmbeddingSharding(
            infos, env, device, qcomm_codecs_registry=codecs
        ),
        sequence=lambda infos, env, device, codecs, hierarchical: UniqueSequenceEmbeddingSharding(
            infos, env, device, qcomm_codecs_registry=codecs
        ),
    ),
)
