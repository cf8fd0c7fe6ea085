"""ShardedEmbeddingBagCollection that also runs our sharding types ("embark_*")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo, KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.fbgemm_qcomm_codec import CommOp
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedTensor

from ..plan.layout.groups import ShardingGroup
from ..plan.layout.torchrec_types import DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE
from .cluster_runtimes import cluster_runtime
from .codecs import builtin_codecs, cluster_codecs
from .sharded_module import EmbarkShardedModule
from .torchrec_compat import (
    add_mean_fixup_features,
    mean_fixup_features,
    module_configs,
    module_device,
    module_env,
    module_input_dists,
    module_sharding_types,
    module_shardings,
)
from .unique import UniqueShardingContext, UniqueSparseFeaturesDist
from .validation import check_equal_batches


# TorchRec's types whose output dist reduce-scatters partial sums per rank (and whose MEAN tables it fixes up)
_REDUCE_SCATTER_TYPES = (ROW_WISE, TABLE_ROW_WISE)


def _torchrec_type(sharding_type: str) -> str | None:
    """The TorchRec sharding type that runs a group of this module's string, None for ours."""
    return ShardingGroup.parse(sharding_type).torchrec_type


def _by_pooling(configs: Any) -> Dict[str, List[str]]:
    """The features of these tables per pooling type's value, as TorchRec's MEAN fix-up lists them."""
    out: Dict[str, List[str]] = {}
    for c in configs:
        out.setdefault(c.pooling.value, []).extend(c.feature_names)
    return out


class EmbarkShardedEmbeddingBagCollection(EmbarkShardedModule, ShardedEmbeddingBagCollection):
    """torchrec builds one EmbeddingSharding per distinct sharding-type string, so each EMBark
    cluster variant (one string) gets its own dists; built-in strings go to torchrec.

    Two torchrec 1.8 behaviours are corrected here:
    - its MEAN fix-up for row-wise / table-row-wise tables divides every other feature of the
      collection by its bag length too; we mark all other features as SUM for that fix-up, and
      multiply back the columns of a shared feature's other tables, which it divides per feature;
    - its load_state_dict merges a rank's local shards as equal-width column slices; ours may
      differ in rows and widths, so weights are loaded shard by shard, matched by offsets.
    """

    _counts_torchrec_shardings = True  # torchrec_counting.py hooks TorchRec's pooled dists too

    def __init__(
        self,
        module: EmbeddingBagCollectionInterface,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        *args: Any,
        invalid_ids: str = "raise",
        unique_lookup: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(module, table_name_to_parameter_sharding, *args, **kwargs)
        add_mean_fixup_features(  # TorchRec lists its row-wise features by their fp32 strings only
            self,
            _by_pooling(
                c
                for c in module_configs(self)
                if table_name_to_parameter_sharding[c.name].sharding_type not in _REDUCE_SCATTER_TYPES
                and _torchrec_type(table_name_to_parameter_sharding[c.name].sharding_type) in _REDUCE_SCATTER_TYPES
            ),
        )
        self._init_embark(
            invalid_ids,
            unique_lookup,
            uniform_batch_features=[  # TorchRec's data-parallel output dist cannot expand a variable batch
                f
                for sharding_type, sharding in zip(module_sharding_types(self), module_shardings(self))
                if sharding_type == DATA_PARALLEL
                for f in sharding.feature_names()
            ],
            weighted=module.is_weighted(),
        )
        self._reduce_scatter_shardings = [  # TorchRec's types whose output dist reduce-scatters per rank
            i for i, t in enumerate(module_sharding_types(self)) if _torchrec_type(t) in _REDUCE_SCATTER_TYPES
        ]
        fixup = mean_fixup_features(self)
        self._undivide: Optional[torch.Tensor] = None
        if fixup is not None:
            divided = set(fixup[PoolingType.MEAN.value])
            features = [f for sharding in module_shardings(self) for f in sharding.feature_names()]
            fixup[PoolingType.SUM.value] = [f for f in dict.fromkeys(features) if f not in divided]
            self._undivide = self._wrongly_divided_columns(divided)

    def _wrongly_divided_columns(self, divided: set[str]) -> Optional[torch.Tensor]:
        """The output columns TorchRec's MEAN fix-up divides but must not. It keeps the bag lengths of
        every KJT key (a shared feature once per table, in the output's order) and sets them to 1 only
        at the first occurrence of each SUM-marked feature: so a feature of a row-wise / table-row-wise
        MEAN table is divided in every table reading it, and a shared feature's later copies are
        divided whatever they are. None when no column is wrong."""
        table_of = {
            name: config.name
            for config, names in zip(module_configs(self), get_embedding_names_by_table(module_configs(self)))
            for name in names
        }
        mean_tables = {c.name for c in module_configs(self) if c.pooling == PoolingType.MEAN}
        wrong: List[bool] = []
        seen: set[str] = set()
        for sharding_type, sharding in zip(module_sharding_types(self), module_shardings(self)):
            row_split = _torchrec_type(sharding_type) in _REDUCE_SCATTER_TYPES
            for feature, name, dim in zip(
                sharding.feature_names(), sharding.embedding_names(), sharding.embedding_dims()
            ):
                is_divided = feature in divided or feature in seen
                seen.add(feature)
                should = row_split and table_of[name] in mean_tables
                wrong += [is_divided and not should] * int(dim)
        if not any(wrong):
            return None
        return torch.tensor(wrong, device=module_device(self))

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
        group = ShardingGroup.parse(sharding_type)
        builtin = group.torchrec_type
        if builtin is not None:
            qcomm_codecs_registry = builtin_codecs(group, qcomm_codecs_registry)
            if builtin != sharding_type:  # TorchRec dispatches on the infos' type string
                sharding_infos = [
                    replace(info, param_sharding=replace(info.param_sharding, sharding_type=builtin))
                    for info in sharding_infos
                ]
            return super().create_embedding_bag_sharding(
                sharding_infos,
                env,
                device,
                permute_embeddings=permute_embeddings,
                qcomm_codecs_registry=qcomm_codecs_registry,
            )
        codecs = cluster_codecs(group.precision, qcomm_codecs_registry, CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
        return cluster_runtime(group.cluster_kind).pooled(sharding_infos, env, device, codecs, group.hierarchical)

    def embedding_configs(self) -> List[Any]:
        return module_configs(self)

    def embedding_shardings(self) -> List[Any]:
        return module_shardings(self)

    def embedding_sharding_types(self) -> List[str]:
        return module_sharding_types(self)

    def _own_context(self, ctx: EmbeddingBagCollectionContext, index: int, torchrec_context: Any) -> Any:
        """Our dists pad every feature to the longest batch (variable_batch.py); a UB dist's de-duplication state
        goes into the batch's context, where its output dist finds it (pipelined batches each carry their own)."""
        if ctx.variable_batch_per_feature:
            longest = max(torchrec_context.batch_size_per_feature_pre_a2a, default=0)
            torchrec_context.batch_size_per_feature_pre_a2a = [longest] * len(
                torchrec_context.batch_size_per_feature_pre_a2a
            )
        input_dist = module_input_dists(self)[index]
        if not isinstance(input_dist, UniqueSparseFeaturesDist):
            return torchrec_context
        return UniqueShardingContext(
            batch_size_per_rank=torchrec_context.batch_size_per_rank,
            batch_size_per_rank_per_feature=torchrec_context.batch_size_per_rank_per_feature,
            batch_size_per_feature_pre_a2a=torchrec_context.batch_size_per_feature_pre_a2a,
            variable_batch_per_feature=torchrec_context.variable_batch_per_feature,
            unique=input_dist.take_state(),
        )

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input: KJTList) -> Any:
        """EmbarkShardedModule's, after every rank's batch size is checked for TorchRec's reduce-scatters; TorchRec's
        MEAN fix-up of row-wise tables is undone where it divides columns it must not (_wrongly_divided_columns)."""
        if not ctx.variable_batch_per_feature:
            contexts = self.sharding_contexts(ctx)
            for i in self._reduce_scatter_shardings:
                check_equal_batches(
                    contexts[i].batch_size_per_rank, module_env(self).rank, module_sharding_types(self)[i]
                )
        awaitable = super().compute_and_output_dist(ctx, input)
        if self._undivide is not None and ctx.divisor is not None:
            undivide = torch.where(self._undivide, ctx.divisor, torch.ones_like(ctx.divisor))
            awaitable.callbacks.append(
                lambda kt: KeyedTensor(
                    keys=kt.keys(), values=kt.values() * undivide, length_per_key=kt.length_per_key(), key_dim=1
                )
            )
        return awaitable

    @staticmethod
    def _pre_load_state_dict_hook(
        self: "EmbarkShardedEmbeddingBagCollection", state_dict: Dict[str, Any], prefix: str, *args: Any
    ) -> None:
        self.load_cells(state_dict, f"{prefix}embedding_bags.")
        ShardedEmbeddingBagCollection._pre_load_state_dict_hook(self, state_dict, prefix, *args)
