"""EmbarkEmbeddingCollectionSharder: TorchRec's EmbeddingCollection sharder, plus our sharding types
for sequence tables (grid and unique-based, sequence.py), each cluster at its plan's wire precision.

TorchRec's own EC types (data_parallel, table_wise, column_wise, row_wise) pass through to TorchRec.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding import (
    EmbeddingCollectionContext,
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.fbgemm_qcomm_codec import CommOp
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingCollection

from ..plan.layout.groups import ShardingGroup
from ..plan.model.fields import SEQUENCE
from .cluster_runtimes import cluster_runtime
from .codecs import builtin_codecs, cluster_codecs
from .sequence import EmbarkSequenceContext, GridSequenceFeaturesDist
from .sharded_module import EmbarkShardedModule
from .sharder import check_sharder_mappings
from .torchrec_compat import (
    is_virtual_table,
    local_shards_by_table,
    module_input_dists,
    module_lookups,
    sequence_configs,
    sequence_sharding_types,
    sequence_shardings,
    uses_index_dedup,
)
from .unique import UniqueSparseFeaturesDist
from .validation import INVALID_ID_POLICIES


class EmbarkShardedEmbeddingCollection(EmbarkShardedModule, ShardedEmbeddingCollection):
    """TorchRec builds one EmbeddingSharding per distinct sharding-type string, so each EMBark
    cluster variant gets its own dists; built-in strings go to TorchRec. Every batch is checked
    first (validation.py), for every sharding type. Byte counting covers our types' input KJT
    all-to-alls and embedding all-to-alls; TorchRec's own EC types are not counted."""

    _counts_torchrec_shardings = False  # torchrec_counting.py hooks TorchRec's pooled dists only

    def __init__(self, *args: Any, invalid_ids: str = "raise", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_embark(
            invalid_ids,
            "padded",  # a sequence lookup takes each distinct ID as a bag of one
            weighted=False,  # TorchRec's EmbeddingCollection takes no per-sample weights: its shardings drop them
            collection="EmbeddingCollection",
        )

    @classmethod
    def create_embedding_sharding(
        cls,
        sharding_type: str,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        group = ShardingGroup.parse(sharding_type, SEQUENCE)
        if group.torchrec_type is not None:
            return super().create_embedding_sharding(
                group.torchrec_type,
                sharding_infos,
                env,
                device,
                qcomm_codecs_registry=builtin_codecs(group, qcomm_codecs_registry),
            )
        codecs = cluster_codecs(group.precision, qcomm_codecs_registry, CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)
        return cluster_runtime(group.cluster_kind).sequence(sharding_infos, env, device, codecs, False)

    def _embedding_dim_for_sharding_type(self, sharding_type: str) -> int:
        """TorchRec views each lookup's output as rows of this width; our cells may be narrower than
        the table and of several widths, so our dists take it as single elements."""
        if ShardingGroup.parse(sharding_type, SEQUENCE).torchrec_type is None:
            return 1
        return super()._embedding_dim_for_sharding_type(sharding_type)

    def embedding_configs(self) -> List[Any]:
        return sequence_configs(self)

    def embedding_shardings(self) -> List[Any]:
        return sequence_shardings(self)

    def embedding_sharding_types(self) -> List[str]:
        return sequence_sharding_types(self)

    def _own_context(self, ctx: EmbeddingCollectionContext, index: int, torchrec_context: Any) -> EmbarkSequenceContext:
        """Our output dists' state from this batch's input dist: the grid's placement, or UB's de-duplication."""
        input_dist = module_input_dists(self)[index]
        own = EmbarkSequenceContext(features_before_input_dist=torchrec_context.features_before_input_dist)
        if isinstance(input_dist, GridSequenceFeaturesDist):
            own.placement = input_dist.take_state()
        elif isinstance(input_dist, UniqueSparseFeaturesDist):
            own.unique = input_dist.take_state()
        return own

    @staticmethod
    def _pre_load_state_dict_hook(
        self: "EmbarkShardedEmbeddingCollection", state_dict: Dict[str, Any], prefix: str, *args: Any
    ) -> None:
        """Loads each local cell from its own region of the incoming weight. TorchRec's hook views a rank's
        shards of a table as rows of the table's first shard's width, which breaks on any cell of another width
        (our uneven column slices, e.g. after dcp.load from another plan); virtual tables stay with TorchRec's."""
        if any(is_virtual_table(self, table) for table in local_shards_by_table(self)):
            ShardedEmbeddingCollection._pre_load_state_dict_hook(self, state_dict, prefix, *args)
            return
        self.load_cells(state_dict, f"{prefix}embeddings.")
        for lookup in module_lookups(self):  # as TorchRec's hook ends: drop what caches hold of the old weights
            while isinstance(lookup, DistributedDataParallel):
                lookup = lookup.module
            lookup.purge()


class EmbarkEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """Runs our plans (and any TorchRec plan) for EmbeddingCollections in DistributedModelParallel.

    sharding_types() lists TorchRec's EC types; our "embark_*" types are not listed, since TorchRec's
    planner cannot cost them, but shard() runs them. invalid_ids as for
    EmbarkEmbeddingBagCollectionSharder: "raise" (default), "clamp" or "drop".
    """

    def __init__(self, *args: Any, invalid_ids: str = "raise", **kwargs: Any) -> None:
        if invalid_ids not in INVALID_ID_POLICIES:
            raise ValueError(f"invalid_ids must be one of {INVALID_ID_POLICIES}, got {invalid_ids!r}")
        super().__init__(*args, **kwargs)
        check_sharder_mappings(self)
        self.invalid_ids = invalid_ids

    def shard(
        self,
        module: EmbeddingCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> EmbarkShardedEmbeddingCollection:
        return EmbarkShardedEmbeddingCollection(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=uses_index_dedup(self),
            module_fqn=module_fqn,
            invalid_ids=self.invalid_ids,
        )

    @property
    def sharded_module_type(self) -> Type[EmbarkShardedEmbeddingCollection]:
        return EmbarkShardedEmbeddingCollection
