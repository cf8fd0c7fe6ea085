"""ShardedEmbeddingBagCollection that also runs our sharding types ("embark_*")."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv

from ..plan.layout import SHARDING_TYPE_PREFIX, parse_sharding_type
from .grid import GridPooledEmbeddingSharding


class EmbarkShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """torchrec builds one EmbeddingSharding per distinct sharding-type string, so each EMBark
    cluster variant (one string) gets its own dists; built-in strings go to torchrec."""

    @classmethod
    def create_embedding_bag_sharding(
        cls,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        if not sharding_type.startswith(SHARDING_TYPE_PREFIX):
            return super().create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings=permute_embeddings, qcomm_codecs_registry=qcomm_codecs_registry
            )
        _, hierarchical, _ = parse_sharding_type(sharding_type)
        return GridPooledEmbeddingSharding(
            sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry, hierarchical=hierarchical
        )
