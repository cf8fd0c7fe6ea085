"""TorchRec and fbgemm internals our runtime relies on, in one place, so an upgrade breaks here.

Each function names the private attribute it reads; tests/test_torchrec_compat.py checks that each
still exists on the installed TorchRec.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Tuple

import fbgemm_gpu
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import PoolingType

# fbgemm's TBE accepts variable batch sizes per feature only with these optimizers
# (SplitTableBatchedEmbeddingBagsCodegen._generate_vbe_metadata asserts it), keyed by the fbgemm release
# whose check first lists them, from the oldest we support (1.6).
_VARIABLE_BATCH_OPTIMIZERS_SINCE = {
    (1, 6): (
        "EXACT_ROWWISE_ADAGRAD",
        "EXACT_SGD",
        "ENSEMBLE_ROWWISE_ADAGRAD",
        "EMAINPLACE_ROWWISE_ADAGRAD",
        "NONE",
        "ADAM",
    ),
    (1, 9): ("ROWWISE_RMSPROP_AR",),
}


def fbgemm_release(version: str) -> tuple[int, int]:
    """fbgemm_gpu's major and minor release in a version string ("1.9.0+cpu" -> (1, 9)), which decides the
    internals it has."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"fbgemm_gpu version {version!r} does not start with <major>.<minor>")
    return int(match.group(1)), int(match.group(2))


VARIABLE_BATCH_OPTIMIZERS = frozenset(
    EmbOptimType[name]
    for since, names in _VARIABLE_BATCH_OPTIMIZERS_SINCE.items()
    if since <= fbgemm_release(fbgemm_gpu.__version__)
    for name in names
)


def has_rowwise_state(optimizer: Any) -> bool:
    """Whether a fused optimizer keeps state per row (one value per row, e.g. EXACT_ROWWISE_ADAGRAD's
    momentum1). TorchRec's EmbeddingFusedOptimizer (batched_embedding_kernel.py) lays such state out
    as one global 1-D tensor only for tables cut by rows or by columns alone, or for its own grid
    (column slices row-split over one node's ranks): it sizes a grid's state as rows x shards /
    get_node_group_size(), which a row x column grid of ours generally is not."""
    name = str(getattr(optimizer, "name", optimizer)).upper()
    return "ROWWISE" in name and name in EmbOptimType.__members__


def managed_collision_embeddings(module: Any) -> Any:
    """The EmbeddingBagCollection or EmbeddingCollection inside a managed-collision module
    (ManagedCollisionEmbeddingBagCollection or ManagedCollisionEmbeddingCollection: its
    `_embedding_module`), or None for any other module."""
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    return module._embedding_module if isinstance(module, BaseManagedCollisionEmbeddingCollection) else None


def managed_collision_input_sizes(module: Any) -> Dict[str, int]:
    """Each table's range of raw IDs in a managed-collision module (`_managed_collision_collection`'s
    `_managed_collision_modules`, by table: their input_size(), e.g. MCHManagedCollisionModule's input_hash_size)."""
    modules = module._managed_collision_collection._managed_collision_modules
    return {table: int(m.input_size()) for table, m in modules.items()}


def managed_collision_collection(sharded: Any) -> Any:
    """A sharded managed-collision module's ShardedManagedCollisionCollection (`_managed_collision_collection`),
    which runs its input dist."""
    return sharded._managed_collision_collection


def sharded_managed_collision_embeddings(sharded: Any) -> Any:
    """The sharded EmbeddingBagCollection or EmbeddingCollection inside a sharded managed-collision module
    (`_embedding_module`)."""
    return sharded._embedding_module


def on_input_dists_created(collisions: Any, then: Callable[[List[Any]], None]) -> None:
    """Calls `then` with a ShardedManagedCollisionCollection's input dists (`_input_dists`) once they exist: now, or
    when its `_create_input_dists` builds them on the first batch (wrapped on this instance)."""
    if not collisions._has_uninitialized_input_dists:
        then(collisions._input_dists)
        return
    create = collisions._create_input_dists

    def created(*args: Any, **kwargs: Any) -> None:
        create(*args, **kwargs)
        then(collisions._input_dists)

    collisions._create_input_dists = created


def storage_reservation_share(reservation: Any) -> Any:
    """The share of device memory a TorchRec storage reservation keeps free (`_percentage`, which
    HeuristicalStorageReservation and FixedPercentageStorageReservation hold), 0.0 for one without."""
    return getattr(reservation, "_percentage", 0.0)


def in_backward_optimizers(module: Any) -> List[Any]:
    """The fused optimizers apply_optimizer_in_backward gave the module's parameters (TorchRec keeps
    them on each parameter as `_optimizer_classes`), as fbgemm types (None for one it has no type for)."""
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

    found = []
    for param in module.parameters():
        for cls in getattr(param, "_optimizer_classes", []):
            try:
                found.append(optimizer_type_to_emb_opt_type(cls))
            except ValueError:
                found.append(None)
    return found


def lookup_tbes(lookup: Any) -> List[Any]:
    """The fbgemm TBEs behind a TorchRec grouped lookup (`_emb_modules[i].emb_module`)."""
    return [m.emb_module for m in getattr(lookup, "_emb_modules", [])]


def supports_variable_batch(lookup: Any) -> bool:
    """Whether every TBE of the lookup takes variable batch sizes per feature (fbgemm's `optimizer`
    attribute of a TBE; a TBE without one, e.g. a dense one, does not)."""
    return all(getattr(tbe, "optimizer", None) in VARIABLE_BATCH_OPTIMIZERS for tbe in lookup_tbes(lookup))


def received_peer_order(a2a: Any, peers: int) -> List[int]:
    """The peer each segment of a KJTAllToAll's output comes from, in output order: TorchRec
    reorders what it receives by the all-to-all's `_stagger` (table-row-wise staggers by node;
    dist_data._get_recat's feature order)."""
    stagger = int(getattr(a2a, "_stagger", 1))
    return [x + peers // stagger * y for x in range(peers // stagger) for y in range(stagger)]


def collective_group(module: Any) -> Any:
    """The process group of one of TorchRec's collective modules (KJTAllToAll, PooledEmbeddingsAllToAll,
    PooledEmbeddingsReduceScatter: `_pg`)."""
    return module._pg


def kjt_splits(a2a: Any) -> List[int]:
    """How many keys a KJTAllToAll sends each peer (`_splits`)."""
    return list(a2a._splits)


def collective_codecs(module: Any) -> Any:
    """The qcomms codecs of one of TorchRec's pooled collective modules (`_codecs`), or None."""
    return module._codecs


def pooled_dim_sum_per_rank(a2a: Any) -> List[int]:
    """The columns each rank sends through a PooledEmbeddingsAllToAll (`_dim_sum_per_rank`)."""
    return [int(d) for d in a2a._dim_sum_per_rank]


def has_emb_dims_per_rank(sharding: Any) -> bool:
    """Whether a TorchRec sharding knows each rank's embedding widths per feature (table-wise-like ones)."""
    return hasattr(sharding, "_emb_dim_per_rank_per_feature")


def emb_dims_per_rank(sharding: Any) -> List[List[int]]:
    """Each rank's embedding widths, per feature, in a TorchRec sharding's order
    (`_emb_dim_per_rank_per_feature()`)."""
    return [list(map(int, dims)) for dims in sharding._emb_dim_per_rank_per_feature()]


def build_lazy_output_dists(dist_module: Any) -> None:
    """TorchRec's pooled output dists build their collective modules on first use (`_dist` /
    `_intra_dist` None until `_create_output_dist_module(s)`); build them now, as forward would for
    a fixed batch size, so that hooks on them see the first step too."""
    for m in list(dist_module.modules()):
        if getattr(m, "_dist", False) is None and hasattr(m, "_create_output_dist_module"):
            m._create_output_dist_module(None)
        if getattr(m, "_intra_dist", False) is None and hasattr(m, "_create_output_dist_modules"):
            m._create_output_dist_modules(None)


# ShardedEmbeddingBagCollection (distributed/embeddingbag.py) and ShardedEmbeddingCollection
# (distributed/embedding.py): what our subclasses read of their state (the dists, lookups and env
# have the same names in both).


def module_configs(module: Any) -> List[Any]:
    """The collection's EmbeddingBagConfigs (`_embedding_bag_configs`)."""
    return module._embedding_bag_configs


def module_env(module: Any) -> Any:
    """The module's ShardingEnv (`_env`)."""
    return module._env


def sequence_configs(module: Any) -> List[Any]:
    """A sharded EmbeddingCollection's EmbeddingConfigs (`_embedding_configs`)."""
    return module._embedding_configs


def sequence_shardings(module: Any) -> List[Any]:
    """A sharded EmbeddingCollection's EmbeddingShardings, in its dists' order (`_sharding_type_to_sharding`)."""
    return list(module._sharding_type_to_sharding.values())


def sequence_sharding_types(module: Any) -> List[str]:
    """A sharded EmbeddingCollection's sharding-type strings, in the same order (`_sharding_type_to_sharding`)."""
    return list(module._sharding_type_to_sharding)


def uses_index_dedup(sharder: Any) -> bool:
    """Whether an EmbeddingCollectionSharder de-duplicates indices (`_use_index_dedup`)."""
    return bool(sharder._use_index_dedup)


def module_device(module: Any) -> Any:
    """The device the sharded module was built for (`_device`)."""
    return module._device


def module_shardings(module: Any) -> List[Any]:
    """One EmbeddingSharding per sharding type, in the module's order (`_embedding_shardings`)."""
    return module._embedding_shardings


def module_sharding_types(module: Any) -> List[str]:
    """The sharding-type strings, in the same order (`_sharding_types`)."""
    return module._sharding_types


def module_input_dists(module: Any) -> List[Any]:
    """Per sharding, its input dist (`_input_dists`; empty until the first batch builds them)."""
    return module._input_dists


def module_output_dists(module: Any) -> List[Any]:
    """Per sharding, its output dist (`_output_dists`)."""
    return module._output_dists


def module_lookups(module: Any) -> List[Any]:
    """Per sharding, its lookup (`_lookups`)."""
    return module._lookups


def data_parallel_lookup_ddps(module: Any) -> List[Any]:
    """The DDPs a sharded embedding module wraps its data-parallel shardings' lookups in (`_lookups`, a plain list,
    so not among the module's submodules); none for a sharded module without lookups."""
    from torch.nn.parallel import DistributedDataParallel

    return [lookup for lookup in getattr(module, "_lookups", ()) if isinstance(lookup, DistributedDataParallel)]


def mean_fixup_features(module: Any) -> Any:
    """TorchRec's MEAN fix-up for row-wise / table-row-wise tables: its features per pooling type
    (`_pooling_type_to_rs_features`), or None when the module has no such fix-up
    (`_has_mean_pooling_callback`)."""
    return module._pooling_type_to_rs_features if module._has_mean_pooling_callback else None


def add_mean_fixup_features(module: Any, features_by_pooling: Dict[str, List[str]]) -> None:
    """Adds features to TorchRec's MEAN fix-up of row-wise / table-row-wise tables, which it lists per pooling
    type at construction by their sharding-type strings (`_pooling_type_to_rs_features`, then
    `_has_mean_pooling_callback`); our compressed row-wise groups' strings carry their precision."""
    for pooling, features in features_by_pooling.items():
        module._pooling_type_to_rs_features[pooling].extend(features)
    module._has_mean_pooling_callback = PoolingType.MEAN.value in module._pooling_type_to_rs_features


def local_shards_by_table(module: Any) -> Any:
    """Each model-parallel table's local weight shards (`_model_parallel_name_to_local_shards`)."""
    return module._model_parallel_name_to_local_shards


def is_virtual_table(module: Any, table: str) -> bool:
    """Whether a table is a virtual (key-value) one (`_table_name_to_config[table].use_virtual_table`)."""
    return bool(module._table_name_to_config[table].use_virtual_table)


def skip_missing_weight(module: Any, key: str) -> None:
    """Tells TorchRec's load_state_dict hook that `key` was loaded here (`_skip_missing_weight_key`)."""
    if key not in module._skip_missing_weight_key:
        module._skip_missing_weight_key.append(key)


# EmbeddingSharding (distributed/embedding_sharding.py, sharding/tw_sharding.py): what our shardings read.


def sharding_group(sharding: Any) -> Any:
    """A sharding's process group (`_pg`)."""
    return sharding._pg


def sharding_world_size(sharding: Any) -> int:
    """A sharding's world size (`_world_size`)."""
    return int(sharding._world_size)


def sharding_device(sharding: Any) -> Any:
    """The device a sharding was built for (`_device`), or None."""
    return sharding._device


def sharding_env(sharding: Any) -> Any:
    """A sharding's ShardingEnv (`_env`)."""
    return sharding._env


def sharding_grouped_configs(sharding: Any) -> List[Any]:
    """The grouped table configs a sharding's lookup takes (`_grouped_embedding_configs`)."""
    return sharding._grouped_embedding_configs


def add_grouping_key(table: Any, key: Any) -> None:
    """Keeps a ShardedEmbeddingTable out of any TBE whose tables differ in `key`: TorchRec groups a sharding's
    tables into TBEs by their fused params, of which `_batch_key` is for grouping only (group_tables drops it before
    it builds the TBE)."""
    params = dict(table.fused_params or {})
    params["_batch_key"] = (params.get("_batch_key"), key)
    table.fused_params = params


# KJTAllToAll (distributed/dist_data.py) and what TrainPipelineSparseDist's forward of it returns
# (KJTSplitsAllToAllMeta, distributed/embedding_sharding.py): what input_exchange.py reads.


def input_dist_all_to_all(input_dist: Any) -> Any:
    """The KJTAllToAll an input dist sends its KJT with (`_dist`, which TrainPipelineSparseDist also requires to be
    one), or None for an input dist without one (data-parallel)."""
    from torchrec.distributed.dist_data import KJTAllToAll

    a2a = getattr(input_dist, "_dist", None)
    return a2a if isinstance(a2a, KJTAllToAll) else None


def kjt_stagger(a2a: Any) -> int:
    """How a KJTAllToAll staggers what it receives (`_stagger`; table-row-wise: by node)."""
    return int(a2a._stagger)


def split_meta_input(meta: Any) -> Any:
    """The KJT a KJTSplitsAllToAllMeta would send (`_input`)."""
    return meta._input


def tiled_sharding_spec(shards: List[Any]) -> Any:
    """torch's EnumerableShardingSpec of `shards` (ShardMetadata), built without the pairwise overlap check of its
    __post_init__ (a sweep line whose active set is a whole row of cells: 19 s at 50,000 cells of one table, minutes
    at 100,000). Only for shards a layout's grid made: TableLayout.validate and grid_from_shards already proved that
    they tile the table exactly, in linear time. Reads the dataclass field EnumerableShardingSpec.shards."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    spec = object.__new__(EnumerableShardingSpec)
    spec.shards = shards
    return spec


# TorchRec's autograd collectives (distributed/comm_ops.py) and its training pipeline: what stage_times.py times.
# Each X_Req starts its exchange in the forward and waits for the gradients' exchange in its backward; each X_Wait
# (All2All_Seq_Req_Wait for sequences) waits for the forward's result.
_COLLECTIVE_WAITS = (
    ("All2All_Pooled_Wait", "forward", False),
    ("All2All_Pooled_Req", "backward", True),
    ("Variable_Batch_All2All_Pooled_Wait", "forward", False),
    ("Variable_Batch_All2All_Pooled_Req", "backward", True),
    ("All2All_Seq_Req_Wait", "forward", False),
    ("All2All_Seq_Req", "backward", True),
    ("All2Allv_Wait", "forward", False),
    ("All2Allv_Req", "backward", True),
    ("ReduceScatter_Wait", "forward", False),
    ("ReduceScatter_Req", "backward", True),
    ("ReduceScatterBase_Wait", "forward", False),
    ("ReduceScatterBase_Req", "backward", True),
    ("ReduceScatterV_Wait", "forward", False),
    ("ReduceScatterV_Req", "backward", True),
    ("AllGatherBase_Wait", "forward", False),
    ("AllGatherBase_Req", "backward", True),
)


def collective_waits() -> List[Tuple[type, str, bool]]:
    """Where TorchRec's collectives wait for their exchanges: (autograd Function, its static method that waits,
    whether it is the backward's)."""
    from torchrec.distributed import comm_ops

    return [(getattr(comm_ops, name), method, backward) for name, method, backward in _COLLECTIVE_WAITS]


def pipeline_stages() -> List[Tuple[type, str, str]]:
    """TrainPipelineSparseDist's methods that run one stage of a step: (class, method, stage). Its input dist starts
    (`start_sparse_data_dist`) and is waited for (`wait_sparse_data_dist`, which starts the IDs' all-to-all), the
    next batch is made (`enqueue_batch`), and `_backward` runs the loss's backward."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    return [
        (TrainPipelineSparseDist, "start_sparse_data_dist", "input_dist"),
        (TrainPipelineSparseDist, "wait_sparse_data_dist", "input_dist"),
        (TrainPipelineSparseDist, "enqueue_batch", "batch"),
        (TrainPipelineSparseDist, "_backward", "backward"),
    ]
