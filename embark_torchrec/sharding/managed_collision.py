"""Managed-collision modules whose batches are checked like our EBC's and EC's: a bad batch on any rank is every
rank's named error, raised before any rank starts the managed collisions' input all-to-all.

TorchRec's sharded ManagedCollisionEmbeddingBagCollection and ManagedCollisionEmbeddingCollection run their own
input dist (permute, hash preprocessing, row-wise bucketing and a KJT all-to-all, in ManagedCollisionCollection)
before the collection inside them, so our EBC's or EC's check never sees the batch: under TorchRec's managed-collision
sharders a bad batch on one rank crashes there (uint8 IDs inside fbgemm's permute, a negative length inside the
bucketing) while its peers wait in the all-to-all for the process group's timeout. These sharders build the same
modules, plus the check at their door: the batch is checked (validation.py: ID and length dtypes, lengths against
values, negative lengths, missing features, raw IDs outside [0, input_hash_size) of their managed-collision module,
per-sample weights, which the managed collisions drop) and the managed collisions' KJT all-to-alls send their split
sizes with the check's record in one exchange (input_exchange.py), as our modules' do: no collective is added. A
batch with 2-D weights (TorchRec's embedding write path) is passed on unchecked.
"""

from __future__ import annotations

from typing import Any, Dict, Generic, List, Optional, Type, TypeVar

import torch
from torchrec.distributed.embedding_sharding import KJTList
from torchrec.distributed.mc_embedding import (
    ManagedCollisionEmbeddingCollectionSharder,
    ShardedManagedCollisionEmbeddingCollection,
)
from torchrec.distributed.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
from torchrec.distributed.types import Awaitable, ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .comm_stats import CommStats
from .input_exchange import CheckedInput, defer_kjt_all_to_alls
from .sharded_ec import EmbarkEmbeddingCollectionSharder
from .sharder import EmbarkEmbeddingBagCollectionSharder
from .torchrec_compat import (
    managed_collision_collection,
    managed_collision_embeddings,
    managed_collision_input_sizes,
    module_sharding_types,
    on_input_dists_created,
    sequence_sharding_types,
    sharded_managed_collision_embeddings,
)
from .validation import InputValidator


class CheckedManagedCollision(CheckedInput):
    """The check at a sharded managed-collision module's door (see the module docstring), for TorchRec's sharded
    managed-collision module after it in the class's bases, built from the same arguments."""

    def __init__(
        self,
        module: Any,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        e_sharder: Any,
        mc_sharder: ManagedCollisionCollectionSharder,
        env: ShardingEnv,
        device: torch.device,
    ) -> None:
        super().__init__(module, table_name_to_parameter_sharding, e_sharder, mc_sharder, env, device)  # type: ignore[call-arg]
        self._check_batches(module, e_sharder)

    def _check_batches(self, module: Any, sharder: Any) -> None:
        """Builds the check for `module` (the unsharded managed-collision module) and defers the managed collisions'
        KJT all-to-alls to the module's split exchange once their input dists exist (the first batch builds them)."""
        inner = managed_collision_embeddings(module)
        bagged = hasattr(inner, "embedding_bag_configs")
        configs = inner.embedding_bag_configs() if bagged else inner.embedding_configs()
        collisions = managed_collision_collection(self)
        self.comm_stats: Optional[CommStats] = None
        self._validate = InputValidator(
            {c.name: list(c.feature_names) for c in configs},
            managed_collision_input_sizes(module),
            getattr(sharder, "invalid_ids", "raise"),
            # the managed collisions' preprocessing drops 1-D weights (they reach the collection only unpreprocessed)
            weighted=bagged and inner.is_weighted() and not collisions.need_preprocess,
            collection=type(module).__name__,
        )
        types = module_sharding_types if bagged else sequence_sharding_types
        self._inner_sharding_types = types(sharded_managed_collision_embeddings(self))
        on_input_dists_created(collisions, defer_kjt_all_to_alls)

    def embedding_sharding_types(self) -> List[str]:
        return self._inner_sharding_types

    def input_dist(self, ctx: Any, features: KeyedJaggedTensor) -> Awaitable[Awaitable[KJTList]]:
        """CheckedInput's, in front of TorchRec's managed-collision input dist; a batch of embeddings to write
        (TorchRec's write path) goes to TorchRec's unchecked."""
        weights = features.weights_or_none() if isinstance(features, KeyedJaggedTensor) else None
        if weights is not None and weights.dim() == 2:  # TorchRec's write path: embeddings to write, not weights
            return super(CheckedInput, self).input_dist(ctx, features)  # type: ignore[misc]
        return super().input_dist(ctx, features)


class EmbarkShardedManagedCollisionEmbeddingBagCollection(
    CheckedManagedCollision, ShardedManagedCollisionEmbeddingBagCollection
):
    """TorchRec's sharded ManagedCollisionEmbeddingBagCollection, its batches checked at the door."""


class EmbarkShardedManagedCollisionEmbeddingCollection(
    CheckedManagedCollision, ShardedManagedCollisionEmbeddingCollection
):
    """TorchRec's sharded ManagedCollisionEmbeddingCollection, its batches checked at the door."""


M = TypeVar("M", ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)
S = TypeVar("S", EmbarkShardedManagedCollisionEmbeddingBagCollection, EmbarkShardedManagedCollisionEmbeddingCollection)


class _CheckingSharder(Generic[M, S]):
    """What both managed-collision sharders add to TorchRec's, before it in their bases: shard() builds the checking
    module (`_sharded`) from the sharders TorchRec's base keeps (`_e_sharder`, `_mc_sharder`)."""

    _sharded: Type[S]
    _e_sharder: Any
    _mc_sharder: ManagedCollisionCollectionSharder

    def shard(
        self,
        module: M,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> S:
        return self._sharded(module, params, self._e_sharder, self._mc_sharder, env, device or torch.device("cuda"))

    @property
    def sharded_module_type(self) -> Type[S]:
        return self._sharded


class EmbarkManagedCollisionEmbeddingBagCollectionSharder(
    _CheckingSharder[ManagedCollisionEmbeddingBagCollection, EmbarkShardedManagedCollisionEmbeddingBagCollection],
    ManagedCollisionEmbeddingBagCollectionSharder,
):
    """TorchRec's ManagedCollisionEmbeddingBagCollectionSharder around ours (EmbarkEmbeddingBagCollectionSharder by
    default), its sharded modules checking every batch (see the module docstring)."""

    _sharded = EmbarkShardedManagedCollisionEmbeddingBagCollection

    def __init__(
        self,
        ebc_sharder: Optional[EmbarkEmbeddingBagCollectionSharder] = None,
        mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        self.ebc_sharder = ebc_sharder or EmbarkEmbeddingBagCollectionSharder(
            fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry
        )
        self.mc_sharder = mc_sharder or ManagedCollisionCollectionSharder()
        super().__init__(self.ebc_sharder, self.mc_sharder, qcomm_codecs_registry=qcomm_codecs_registry)


class EmbarkManagedCollisionEmbeddingCollectionSharder(
    _CheckingSharder[ManagedCollisionEmbeddingCollection, EmbarkShardedManagedCollisionEmbeddingCollection],
    ManagedCollisionEmbeddingCollectionSharder,
):
    """TorchRec's ManagedCollisionEmbeddingCollectionSharder around ours (EmbarkEmbeddingCollectionSharder by
    default), its sharded modules checking every batch (see the module docstring)."""

    _sharded = EmbarkShardedManagedCollisionEmbeddingCollection

    def __init__(
        self,
        ec_sharder: Optional[EmbarkEmbeddingCollectionSharder] = None,
        mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        self.ec_sharder = ec_sharder or EmbarkEmbeddingCollectionSharder(
            fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry
        )
        self.mc_sharder = mc_sharder or ManagedCollisionCollectionSharder()
        super().__init__(self.ec_sharder, self.mc_sharder, qcomm_codecs_registry=qcomm_codecs_registry)


__all__: List[str] = [
    "EmbarkManagedCollisionEmbeddingBagCollectionSharder",
    "EmbarkManagedCollisionEmbeddingCollectionSharder",
]
