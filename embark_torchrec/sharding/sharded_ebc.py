"""ShardedEmbeddingBagCollection that also runs our sharding types ("embark_*")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo, KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.fbgemm_qcomm_codec import CommOp
from torchrec.distributed.types import Awaitable, ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ..plan.layout.kinds import cluster_kind
from ..plan.layout.groups import torchrec_type
from ..plan.layout.tables import SHARDING_TYPE_PREFIX, parse_sharding_type
from .cluster_runtimes import cluster_runtime
from .codecs import builtin_codecs, cluster_codecs
from .comm_stats import CommStats, CountsComm
from .grid import BaseGridEmbeddingSharding
from .input_exchange import CheckedInput, defer_kjt_all_to_alls
from .torchrec_compat import (
    add_mean_fixup_features,
    is_virtual_table,
    local_shards_by_table,
    mean_fixup_features,
    module_configs,
    module_device,
    module_env,
    module_input_dists,
    module_lookups,
    module_output_dists,
    module_sharding_types,
    module_shardings,
    skip_missing_weight,
)
from .torchrec_counting import KJTCounter, count_borrowed_dists
from .unique import UniquePooledEmbeddingSharding, UniqueShardingContext, UniqueSparseFeaturesDist
from .validation import InputValidator, check_equal_batches


# TorchRec's types whose output dist reduce-scatters partial sums per rank (and whose MEAN tables it fixes up)
_REDUCE_SCATTER_TYPES = ("row_wise", "table_row_wise")


def _by_pooling(configs: Any) -> Dict[str, List[str]]:
    """The features of these tables per pooling type's value, as TorchRec's MEAN fix-up lists them."""
    out: Dict[str, List[str]] = {}
    for c in configs:
        out.setdefault(c.pooling.value, []).extend(c.feature_names)
    return out


def key_tables(configs: List[Any]) -> Dict[str, str]:
    """The table each KJT key the dists send stands for: features, and TorchRec's embedding names
    ("feature@table") that our cells use for a feature read by several tables (the feature itself
    then counts to the first of them)."""
    keys: Dict[str, str] = {}
    for config, names in zip(configs, get_embedding_names_by_table(configs)):
        for feature, name in zip(config.feature_names, names):
            keys.setdefault(feature, config.name)
            keys[name] = config.name
    return keys


def load_cells(module: Any, state_dict: Dict[str, Any], table_prefix: str) -> None:
    """Copies each of the module's local cells from its own region of the incoming weight (a
    ShardedTensor from any plan, matched by offsets, or a full tensor) and takes the weight out of
    `state_dict`. TorchRec's load hooks view a rank's shards of a table as rows of the first shard's
    width, which our cells of other rows and widths break. Virtual tables stay with TorchRec."""
    for table, local_shards in local_shards_by_table(module).items():
        key = f"{table_prefix}{table}.weight"
        value = state_dict.get(key)
        if is_virtual_table(module, table) or not isinstance(value, torch.Tensor):
            continue
        incoming = (
            {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
            if isinstance(value, ShardedTensor)
            else None
        )
        with torch.no_grad():
            for shard in local_shards:
                offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                if incoming is None:
                    source = value[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
                else:
                    source = incoming.get(tuple(offsets))
                if source is None or tuple(source.shape) != tuple(sizes):
                    raise ValueError(
                        f"table {table!r}: the state dict has no shard of shape {list(sizes)} "
                        f"at offsets {list(offsets)} "
                        "for this rank; was it saved with another plan? load it with torch.distributed.checkpoint"
                    )
                shard.tensor.copy_(source)
        del state_dict[key]
        skip_missing_weight(module, key)


class CountedModule:
    """What our sharded EBC and EC share for byte counting (comm_stats.enable_comm_stats): a CommStats
    for the module's process group, and counting its dists into one (each class's `_count_dists`
    says how)."""

    comm_stats: Optional[CommStats]
    _count_dists: Callable[[Any], None]

    def new_comm_stats(self) -> CommStats:
        pg = module_env(self).process_group
        world = dist.get_world_size(pg)
        return CommStats(dist.get_rank(pg), world, get_local_size(world))

    def count_comm(self, stats: CommStats) -> None:
        """Counts this module's collectives into `stats` (see comm_stats.enable_comm_stats)."""
        if self.comm_stats is not None:
            if self.comm_stats is not stats:
                raise ValueError("this module already counts into another CommStats")
            return
        self.comm_stats = stats
        self._count_dists(module_output_dists(self))
        self._count_dists(module_input_dists(self))  # empty until the first batch: see _create_input_dist


class EmbarkShardedEmbeddingBagCollection(CheckedInput, CountedModule, ShardedEmbeddingBagCollection):
    """torchrec builds one EmbeddingSharding per distinct sharding-type string, so each EMBark
    cluster variant (one string) gets its own dists; built-in strings go to torchrec.

    Two torchrec 1.8 behaviours are corrected here:
    - its MEAN fix-up for row-wise / table-row-wise tables divides every other feature of the
      collection by its bag length too; we mark all other features as SUM for that fix-up, and
      multiply back the columns of a shared feature's other tables, which it divides per feature;
    - its load_state_dict merges a rank's local shards as equal-width column slices; ours may
      differ in rows and widths, so weights are loaded shard by shard, matched by offsets.
    """

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
                and torchrec_type(table_name_to_parameter_sharding[c.name].sharding_type) in _REDUCE_SCATTER_TYPES
            ),
        )
        self._unique_lookup = unique_lookup
        self.comm_stats: Optional[CommStats] = None
        self._kjt_counters: Dict[int, KJTCounter] = {}  # sharding index -> its input KJT all-to-all's counter
        self._validate = InputValidator(
            {c.name: list(c.feature_names) for c in module_configs(self)},
            {c.name: c.num_embeddings for c in module_configs(self)},
            invalid_ids,
            uniform_batch_features=[  # TorchRec's data-parallel output dist cannot expand a variable batch
                f
                for kind, sharding in zip(module_sharding_types(self), module_shardings(self))
                if kind == "data_parallel"
                for f in sharding.feature_names()
            ],
            weighted=module.is_weighted(),
        )
        self._embark_shardings = [
            i for i, s in enumerate(module_shardings(self)) if isinstance(s, BaseGridEmbeddingSharding)
        ]
        self._reduce_scatter_shardings = [  # TorchRec's types whose output dist reduce-scatters per rank
            i for i, t in enumerate(module_sharding_types(self)) if torchrec_type(t) in _REDUCE_SCATTER_TYPES
        ]
        self._unique_shardings = [
            (i, sharding)
            for i, sharding in enumerate(module_shardings(self))
            if isinstance(sharding, UniquePooledEmbeddingSharding)
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
        for kind, sharding in zip(module_sharding_types(self), module_shardings(self)):
            row_split = torchrec_type(kind) in _REDUCE_SCATTER_TYPES
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
        if not sharding_type.startswith(SHARDING_TYPE_PREFIX):
            builtin, qcomm_codecs_registry = builtin_codecs(sharding_type, qcomm_codecs_registry)
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
        cluster, hierarchical, precision = parse_sharding_type(sharding_type)
        codecs = cluster_codecs(precision, qcomm_codecs_registry, CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
        return cluster_runtime(cluster_kind(cluster)).pooled(sharding_infos, env, device, codecs, hierarchical)

    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        """The batch checked (validation.py), then torchrec's input dist; then each UB dist's
        de-duplication state goes into this batch's context, where its output dist finds it
        (pipelined batches each carry their own). The request waits the module's split exchange
        first (input_exchange.py), which raises a bad batch's error on every rank; a bad batch
        itself only takes part in the exchange."""
        features, fault = self.check_input(features)
        env = module_env(self)
        if fault is not None:
            return self.exchange_splits(
                ctx, None, fault, env.process_group, module_sharding_types(self), module_device(self)
            )
        awaitable = super().input_dist(ctx, features)
        input_dists = module_input_dists(self)
        first = len(ctx.sharding_contexts) - len(input_dists)
        if ctx.variable_batch_per_feature:  # our dists pad every feature to the longest (variable_batch.py)
            for i in self._embark_shardings:
                base = ctx.sharding_contexts[first + i]
                longest = max(base.batch_size_per_feature_pre_a2a, default=0)
                base.batch_size_per_feature_pre_a2a = [longest] * len(base.batch_size_per_feature_pre_a2a)
        for i, input_dist in enumerate(input_dists):
            if isinstance(input_dist, UniqueSparseFeaturesDist):
                base = ctx.sharding_contexts[first + i]
                ctx.sharding_contexts[first + i] = UniqueShardingContext(
                    batch_size_per_rank=base.batch_size_per_rank,
                    batch_size_per_rank_per_feature=base.batch_size_per_rank_per_feature,
                    batch_size_per_feature_pre_a2a=base.batch_size_per_feature_pre_a2a,
                    variable_batch_per_feature=base.variable_batch_per_feature,
                    unique=input_dist.take_state(),
                )
        return self.exchange_splits(
            ctx, awaitable, None, env.process_group, module_sharding_types(self), module_device(self)
        )

    def _create_input_dist(self, input_feature_names: List[str]) -> None:
        super()._create_input_dist(input_feature_names)
        defer_kjt_all_to_alls(module_input_dists(self))
        if self.comm_stats is not None:
            self._count_dists(module_input_dists(self))

    def _count_dists(self, dists: Any) -> None:
        assert self.comm_stats is not None
        feature_table = key_tables(module_configs(self))
        for i, (sharding_type, sharding, dist_module) in enumerate(
            zip(module_sharding_types(self), module_shardings(self), dists)
        ):
            for m in dist_module.modules():
                if isinstance(m, CountsComm):
                    m.comm_stats, m.comm_sharding_type = self.comm_stats, sharding_type
            counter = count_borrowed_dists(sharding, dist_module, self.comm_stats, sharding_type, feature_table)
            if counter is not None:
                self._kjt_counters[i] = counter

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input: KJTList) -> Any:
        """torchrec's; when counting, the KJT all-to-alls' received bytes are read off their
        output here (the same path with and without TrainPipelineSparseDist). UB groups turn the
        distinct IDs they received into their lookup's input here, and file the received counts
        in the batch's context for their output dist."""
        if not ctx.variable_batch_per_feature:
            for i in self._reduce_scatter_shardings:
                check_equal_batches(
                    ctx.sharding_contexts[i].batch_size_per_rank, module_env(self).rank, module_sharding_types(self)[i]
                )
        for i, counter in self._kjt_counters.items():
            sharding_ctx = ctx.sharding_contexts[i]
            counter.record_received(input[i], sharding_ctx.batch_size_per_rank if sharding_ctx is not None else None)
        if self._unique_shardings:
            features = list(input)
            for i, sharding in self._unique_shardings:
                features[i], ctx.sharding_contexts[i].received_counts = sharding.lookup_input(
                    features[i], module_lookups(self)[i], self._unique_lookup
                )
            input = KJTList(features)
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
        load_cells(self, state_dict, f"{prefix}embedding_bags.")
        ShardedEmbeddingBagCollection._pre_load_state_dict_hook(self, state_dict, prefix, *args)
