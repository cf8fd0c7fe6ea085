"""EmbarkEmbeddingBagCollectionSharder: torchrec's EBC sharder, plus our sharding types."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from .sharded_ebc import EmbarkShardedEmbeddingBagCollection
from .unique import UNIQUE_LOOKUPS
from .validation import INVALID_ID_POLICIES

_BUILTIN_TYPES = [
    ShardingType.DATA_PARALLEL.value,
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
]


def check_sharder_mappings(sharder: object) -> None:
    """TorchRec's sharders keep fused_params and qcomm_codecs_registry as given and read them as dicts only when
    planning or sharding, where a string or a number fails as an AttributeError that names neither: refused when
    the sharder is made, by name."""
    for name in ("fused_params", "qcomm_codecs_registry"):
        value = getattr(sharder, name, None)
        if value is not None and not isinstance(value, Mapping):
            kind = type(value).__name__
            raise TypeError(f"{type(sharder).__name__}: {name} must be a dict or None, got {kind} {value!r}")


class EmbarkEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Runs EmbarkPlanner's plans (and any torchrec plan) in DistributedModelParallel.

    sharding_types() lists every built-in type on every device (stock torchrec hides row-wise,
    table-row-wise and grid on CPU, which run fine on gloo); our "embark_*" types are not listed
    because torchrec's own planner cannot cost them, but shard() runs them.

    invalid_ids: what to do with IDs outside [0, rows) of their table: "raise" (default; the error
    names table, feature and rank), "clamp" into range, or "drop" them from their bags.

    unique_lookup: how unique-based tables look up the distinct IDs they receive (unique.py):
    "variable_batch" (fbgemm's variable-batch TBE: no padding; its CPU kernel is slow), "padded"
    (one batch per cell, padded to the longest), or "auto" (default: variable-batch on GPUs where
    the optimizer allows it, padded otherwise).
    """

    def __init__(self, *args: Any, invalid_ids: str = "raise", unique_lookup: str = "auto", **kwargs: Any) -> None:
        if invalid_ids not in INVALID_ID_POLICIES:
            raise ValueError(f"invalid_ids must be one of {INVALID_ID_POLICIES}, got {invalid_ids!r}")
        if unique_lookup not in UNIQUE_LOOKUPS:
            raise ValueError(f"unique_lookup must be one of {UNIQUE_LOOKUPS}, got {unique_lookup!r}")
        super().__init__(*args, **kwargs)
        check_sharder_mappings(self)
        self.invalid_ids = invalid_ids
        self.unique_lookup = unique_lookup

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> EmbarkShardedEmbeddingBagCollection:
        return EmbarkShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            invalid_ids=self.invalid_ids,
            unique_lookup=self.unique_lookup,
        )

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(_BUILTIN_TYPES)

    @property
    def sharded_module_type(self) -> Type[EmbarkShardedEmbeddingBagCollection]:
        return EmbarkShardedEmbeddingBagCollection
