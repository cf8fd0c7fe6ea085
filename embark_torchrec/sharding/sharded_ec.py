"""EmbarkEmbeddingCollectionSharder: TorchRec's EmbeddingCollection sharder, plus our sharding types
for sequence tables (grid and unique-based, sequence.py), each cluster at its plan's wire precision.

TorchRec's own EC types (data_parallel, table_wise, column_wise, row_wise) pass through to TorchRec.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Type, Union

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionContext,
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo, KJTList
from torchrec.distributed.fbgemm_qcomm_codec import CommOp
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.types import Awaitable, ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..plan.layout.kinds import cluster_kind
from ..plan.layout.tables import SHARDING_TYPE_PREFIX, parse_sharding_type
from .cluster_runtimes import cluster_runtime
from .codecs import builtin_codecs, cluster_codecs
from .comm_stats import CommStats, CountsComm
from .input_exchange import CheckedInput, defer_kjt_all_to_alls
from .sequence import (
    EmbarkSequenceContext,
    GridSequenceEmbeddingSharding,
    GridSequenceFeaturesDist,
    UniqueSequenceEmbeddingSharding,
)
from .sharded_ebc import CountedModule, key_tables, load_cells
from .sharder import check_sharder_mappings
from .torchrec_compat import (
    is_virtual_table,
    local_shards_by_table,
    module_env,
    module_input_dists,
    module_device,
    module_lookups,
    sequence_configs,
    sequence_sharding_types,
    sequence_shardings,
    uses_index_dedup,
)
from .torchrec_counting import KJTCounter, count_borrowed_dists
from .unique import UniqueSparseFeaturesDist
from .validation import INVALID_ID_POLICIES, InputValidator


class EmbarkShardedEmbeddingCollection(CheckedInput, CountedModule, ShardedEmbeddingCollection):
    """TorchRec builds one EmbeddingSharding per distinct sharding-type string, so each EMBark
    cluster variant gets its own dists; built-in strings go to TorchRec. Every batch is checked
    first (validation.py), for every sharding type. Byte counting covers our types' input KJT
    all-to-alls and embedding all-to-alls; TorchRec's own EC types are not counted."""

    def __init__(self, *args: Any, invalid_ids: str = "raise", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm_stats: Optional[CommStats] = None
        self._kjt_counters: Dict[int, KJTCounter] = {}  # sharding index -> its input KJT all-to-all's counter
        self._validate = InputValidator(
            {c.name: list(c.feature_names) for c in sequence_configs(self)},
            {c.name: c.num_embeddings for c in sequence_configs(self)},
            invalid_ids,
            weighted=False,  # TorchRec's EmbeddingCollection takes no per-sample weights: its shardings drop them
            collection="EmbeddingCollection",
        )
        shardings = sequence_shardings(self)
        self._ours = [
            i
            for i, s in enumerate(shardings)
            if isinstance(s, (GridSequenceEmbeddingSharding, UniqueSequenceEmbeddingSharding))
        ]
        self._unique_shardings = [
            (i, s) for i, s in enumerate(shardings) if isinstance(s, UniqueSequenceEmbeddingSharding)
        ]

    @classmethod
    def create_embedding_sharding(
        cls,
        sharding_type: str,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> EmbeddingSharding:
        if not sharding_type.startswith(SHARDING_TYPE_PREFIX):
            builtin, qcomm_codecs_registry = builtin_codecs(sharding_type, qcomm_codecs_registry)
            return super().create_embedding_sharding(
                builtin, sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry
            )
        cluster, _, precision = parse_sharding_type(sharding_type)
        codecs = cluster_codecs(precision, qcomm_codecs_registry, CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL)
        return cluster_runtime(cluster_kind(cluster)).sequence(sharding_infos, env, device, codecs, False)

    def _embedding_dim_for_sharding_type(self, sharding_type: str) -> int:
        """TorchRec views each lookup's output as rows of this width; our cells may be narrower than
        the table and of several widths, so our dists take it as single elements."""
        if sharding_type.startswith(SHARDING_TYPE_PREFIX):
            return 1
        return super()._embedding_dim_for_sharding_type(sharding_type)

    def input_dist(
        self, ctx: EmbeddingCollectionContext, features: Union[KeyedJaggedTensor, Any]
    ) -> Awaitable[Awaitable[KJTList]]:
        """The batch checked, then TorchRec's input dist; then each of our dists' per-batch state
        goes into this batch's context, where its output dist finds it. The request waits the module's
        split exchange first (input_exchange.py), which raises a bad batch's error on every rank."""
        features, fault = self.check_input(features)
        env = module_env(self)
        if fault is not None:
            return self.exchange_splits(
                ctx, None, fault, env.process_group, sequence_sharding_types(self), module_device(self)
            )
        awaitable = super().input_dist(ctx, features)
        first = len(ctx.sharding_contexts) - len(module_input_dists(self))
        for i in self._ours:
            input_dist = module_input_dists(self)[i]
            base = ctx.sharding_contexts[first + i]
            sharding_ctx = EmbarkSequenceContext(features_before_input_dist=base.features_before_input_dist)
            if isinstance(input_dist, GridSequenceFeaturesDist):
                sharding_ctx.placement = input_dist.take_state()
            elif isinstance(input_dist, UniqueSparseFeaturesDist):
                sharding_ctx.unique = input_dist.take_state()
            ctx.sharding_contexts[first + i] = sharding_ctx
        return self.exchange_splits(
            ctx, awaitable, None, env.process_group, sequence_sharding_types(self), module_device(self)
        )

    def compute_and_output_dist(self, ctx: EmbeddingCollectionContext, input: KJTList) -> Any:
        """TorchRec's; when counting, the KJT all-to-alls' received bytes are read off their output
        here. UB groups turn the distinct IDs they received into their lookup's input (each ID a bag
        of one) and file the received counts in the batch's context for their output dist."""
        for i, counter in self._kjt_counters.items():
            counter.record_received(input[i], ctx.sharding_contexts[i].batch_size_per_rank)
        if self._unique_shardings:
            features = list(input)
            for i, sharding in self._unique_shardings:
                sharding_ctx = ctx.sharding_contexts[i]
                assert isinstance(sharding_ctx, EmbarkSequenceContext)
                features[i], sharding_ctx.received_counts = sharding.lookup_input(
                    features[i], module_lookups(self)[i], "padded"
                )
            input = KJTList(features)
        return super().compute_and_output_dist(ctx, input)

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
        load_cells(self, state_dict, f"{prefix}embeddings.")
        for lookup in module_lookups(self):  # as TorchRec's hook ends: drop what caches hold of the old weights
            while isinstance(lookup, DistributedDataParallel):
                lookup = lookup.module
            lookup.purge()

    def _create_input_dist(
        self, input_feature_names: List[str], ctx: Optional[EmbeddingCollectionContext] = None
    ) -> None:
        super()._create_input_dist(input_feature_names, ctx)
        defer_kjt_all_to_alls(module_input_dists(self))
        if self.comm_stats is not None:
            self._count_dists(module_input_dists(self))

    def _count_dists(self, dists: List[torch.nn.Module]) -> None:
        assert self.comm_stats is not None
        feature_table = key_tables(sequence_configs(self))
        types, shardings = sequence_sharding_types(self), sequence_shardings(self)
        for i in self._ours:
            if i >= len(dists):
                continue
            for m in dists[i].modules():
                if isinstance(m, CountsComm):
                    m.comm_stats, m.comm_sharding_type = self.comm_stats, types[i]
            counter = count_borrowed_dists(shardings[i], dists[i], self.comm_stats, types[i], feature_table)
            if counter is not None:
                self._kjt_counters[i] = counter


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
