"""The TorchRec and fbgemm internals torchrec_compat.py relies on still exist on the installed versions, so a
TorchRec upgrade that moves them fails here, by name, rather than deep inside a training step.  Run on every
TorchRec we support (1.6 to 1.9: `make test-torchrec VERSION=...`)."""

from __future__ import annotations

import dataclasses
import inspect

import fbgemm_gpu
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup

from embark_torchrec.sharding.torchrec_compat import (
    VARIABLE_BATCH_OPTIMIZERS,
    fbgemm_release,
    lookup_tbes,
    supports_variable_batch,
    tiled_sharding_spec,
)

pytestmark = pytest.mark.torchrec_version


def _tbe(optimizer: EmbOptimType) -> SplitTableBatchedEmbeddingBagsCodegen:
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=optimizer, learning_rate=0.1
    )


def test_tbe_optimizer_attribute_and_variable_batch_rule() -> None:
    """fbgemm's TBE keeps its optimizer in `optimizer`, and the installed fbgemm's variable-batch check lists exactly
    the optimizers we treat as variable-batch capable for its release (read off the source of the check)."""
    assert _tbe(EmbOptimType.EXACT_SGD).optimizer == EmbOptimType.EXACT_SGD
    source = inspect.getsource(SplitTableBatchedEmbeddingBagsCodegen._generate_vbe_metadata)
    listed = {o for o in EmbOptimType if f"OptimType.{o.name}," in source or f"OptimType.{o.name}\n" in source}
    assert listed == set(VARIABLE_BATCH_OPTIMIZERS), fbgemm_gpu.__version__


def test_fbgemm_release_reads_major_and_minor() -> None:
    """The release that picks fbgemm's internals is read off version strings as fbgemm's wheels spell them, and one
    that is not a version is refused by name rather than read as some release."""
    assert fbgemm_release("1.8.0") == (1, 8)
    assert fbgemm_release("1.9.0+cpu") == (1, 9)
    assert fbgemm_release("1.10.1") == (1, 10)
    with pytest.raises(ValueError, match="'nightly'"):
        fbgemm_release("nightly")


def test_grouped_lookup_keeps_its_tbes_in_emb_modules() -> None:
    """TorchRec's grouped lookup holds one module per TBE in `_emb_modules`, each exposing `emb_module`."""
    assert "_emb_modules" in inspect.getsource(GroupedPooledEmbeddingsLookup.__init__)

    class Wrapped(torch.nn.Module):
        def __init__(self, tbe: SplitTableBatchedEmbeddingBagsCodegen) -> None:
            super().__init__()
            self.emb_module = tbe

    class Lookup(torch.nn.Module):
        def __init__(self, *tbes: SplitTableBatchedEmbeddingBagsCodegen) -> None:
            super().__init__()
            self._emb_modules = torch.nn.ModuleList(Wrapped(t) for t in tbes)

    sgd, adagrad = _tbe(EmbOptimType.EXACT_SGD), _tbe(EmbOptimType.EXACT_ADAGRAD)
    assert lookup_tbes(Lookup(sgd)) == [sgd]
    assert supports_variable_batch(Lookup(sgd, _tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD)))
    assert not supports_variable_batch(Lookup(sgd, adagrad))


def test_received_peer_order_follows_torchrec_recat() -> None:
    """KJTAllToAll keeps its stagger in `_stagger`, and the order in which its output holds each peer's
    segment is the feature order of TorchRec's own recat (dist_data._get_recat), staggered or not."""
    from torchrec.distributed.dist_data import KJTAllToAll, _get_recat

    from embark_torchrec.sharding.torchrec_compat import received_peer_order

    assert "self._stagger = stagger" in inspect.getsource(KJTAllToAll.__init__)

    class Staggered:
        _stagger = 2

    for a2a, stagger in ((Staggered(), 2), (object(), 1)):
        recat = _get_recat(local_split=1, num_splits=4, stagger=stagger)
        assert recat is not None
        assert received_peer_order(a2a, 4) == recat.tolist()


def test_collective_and_sharding_internals_exist() -> None:
    """The private attributes torchrec_compat reads off TorchRec's collective modules, output dists and shardings
    are still set where it expects them (read off TorchRec's source, as they need process groups to build)."""
    from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding, BaseBatchedEmbeddingBag
    from torchrec.distributed.dist_data import KJTAllToAll, PooledEmbeddingsAllToAll, PooledEmbeddingsReduceScatter
    from torchrec.distributed.sharding.tw_sharding import BaseTwEmbeddingSharding, TwPooledEmbeddingDist
    from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
    from torchrec.distributed.types import Awaitable

    def source(obj: object) -> str:
        return inspect.getsource(obj)  # type: ignore[arg-type]

    kjt = source(KJTAllToAll.__init__)
    assert "self._pg" in kjt and "self._splits" in kjt
    pooled = source(PooledEmbeddingsAllToAll.__init__)
    assert "self._pg" in pooled and "self._codecs" in pooled and "self._dim_sum_per_rank" in pooled
    reduce_scatter = source(PooledEmbeddingsReduceScatter.__init__)
    assert "self._pg" in reduce_scatter and "self._codecs" in reduce_scatter
    for kernel in (BaseBatchedEmbeddingBag, BaseBatchedEmbedding):  # what a grouped lookup's _emb_modules hold
        assert isinstance(inspect.getattr_static(kernel, "emb_module"), property), kernel
    assert "self._dist" in source(TwPooledEmbeddingDist.__init__)
    assert callable(TwPooledEmbeddingDist._create_output_dist_module)
    assert "self._intra_dist" in source(TwRwPooledEmbeddingDist.__init__)
    assert callable(TwRwPooledEmbeddingDist._create_output_dist_modules)
    assert callable(BaseTwEmbeddingSharding._emb_dim_per_rank_per_feature)
    assert "_wait_impl" in Awaitable.__abstractmethods__  # what collectives.AllToAllAwaitable implements


def test_the_collective_waits_and_pipeline_stages_the_stage_timer_replaces_exist() -> None:
    """What stage_times.py times on TorchRec: each collective's waiting method is a static method of that autograd
    Function that waits for its request (X_Wait's forward, X_Req's backward), and TrainPipelineSparseDist still runs
    its stages in those methods."""
    from embark_torchrec.sharding.torchrec_compat import collective_waits, pipeline_stages

    waits = collective_waits()
    assert len(waits) == 16 and {backward for _, _, backward in waits} == {False, True}
    for function, method, backward in waits:
        assert isinstance(function.__dict__[method], staticmethod), (function, method)
        assert ".wait()" in inspect.getsource(getattr(function, method)), (function, method)
        assert function.__name__.endswith("_Req") == backward, function
    for owner, method, _ in pipeline_stages():
        assert callable(owner.__dict__[method]), method
    progress = inspect.getsource(pipeline_stages()[0][0].progress)
    assert all(f"self.{method}(" in progress for _, method, _ in pipeline_stages()), progress


def test_in_backward_optimizers_and_managed_collision_inner_module() -> None:
    """apply_optimizer_in_backward leaves each parameter's optimizer class in `_optimizer_classes`, which
    in_backward_optimizers maps to fbgemm's type through TorchRec's own mapping; a managed-collision module keeps the
    collection it wraps in `_embedding_module`."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from embark_torchrec.sharding.torchrec_compat import in_backward_optimizers

    table = EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=4, feature_names=["f0"])
    ebc = EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
    assert in_backward_optimizers(ebc) == []
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    assert in_backward_optimizers(ebc) == [EmbOptimType.EXACT_ROWWISE_ADAGRAD]
    assert "self._embedding_module" in inspect.getsource(BaseManagedCollisionEmbeddingCollection.__init__)


def test_fused_optimizer_sizes_grid_rowwise_state_by_node_group() -> None:
    """TorchRec's EmbeddingFusedOptimizer still sizes a row x column table's row-wise state as rows x shards /
    get_node_group_size() (why our grids are refused for optimizers with per-row state)."""
    from torchrec.distributed.batched_embedding_kernel import EmbeddingFusedOptimizer

    from embark_torchrec.sharding.torchrec_compat import has_rowwise_state

    source = inspect.getsource(EmbeddingFusedOptimizer.__init__)
    assert "get_node_group_size()" in source and "is_grid_sharded" in source
    assert has_rowwise_state("EXACT_ROWWISE_ADAGRAD") and not has_rowwise_state(None)
    assert not has_rowwise_state(EmbOptimType.EXACT_ADAGRAD)


def test_sharded_ebc_and_sharding_state_our_subclasses_read() -> None:
    """Every private attribute of TorchRec's ShardedEmbeddingBagCollection and EmbeddingSharding that
    torchrec_compat's accessors read is still set by TorchRec, and every private method our subclasses override
    still exists on the parent (else the override would silently never run)."""
    from torchrec.distributed.embedding_sharding import EmbeddingSharding
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.sharding.tw_sharding import BaseTwEmbeddingSharding

    ebc_source = inspect.getsource(ShardedEmbeddingBagCollection)
    for attr in (
        "_embedding_bag_configs",
        "_env",
        "_embedding_shardings",
        "_sharding_types",
        "_input_dists",
        "_output_dists",
        "_lookups",
        "_pooling_type_to_rs_features",
        "_has_mean_pooling_callback",
        "_model_parallel_name_to_local_shards",
        "_table_name_to_config",
        "_skip_missing_weight_key",
        "_device",
    ):
        assert f"self.{attr} =" in ebc_source or f"self.{attr}:" in ebc_source, attr
    sharding_source = inspect.getsource(EmbeddingSharding) + inspect.getsource(BaseTwEmbeddingSharding)
    for attr in ("_pg", "_world_size", "_device"):
        assert f"self.{attr} =" in sharding_source or f"self.{attr}:" in sharding_source, attr
    assert callable(getattr(ShardedEmbeddingBagCollection, "_create_input_dist"))
    assert callable(getattr(ShardedEmbeddingBagCollection, "_pre_load_state_dict_hook"))
    assert callable(getattr(BaseTwEmbeddingSharding, "_shard"))


def test_sharded_ec_state_our_subclass_reads() -> None:
    """The same for TorchRec's ShardedEmbeddingCollection, its sharder and the sharding state our sequence lookups
    read; and TorchRec still drops the fused param our sequence cells are grouped by before it builds a TBE."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
    from torchrec.distributed.embedding_sharding import EmbeddingSharding, group_tables
    from torchrec.distributed.sharding.tw_sharding import BaseTwEmbeddingSharding
    from torchrec.modules.embedding_configs import EmbeddingConfig

    def sets(cls: type, attr: str) -> bool:
        source = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("torchrec"))
        return f"self.{attr} =" in source or f"self.{attr}:" in source

    for attr in (
        "_embedding_configs",
        "_sharding_type_to_sharding",
        "_input_dists",
        "_output_dists",
        "_lookups",
        "_model_parallel_name_to_local_shards",
        "_table_name_to_config",
    ):
        assert sets(ShardedEmbeddingCollection, attr), attr
    assert "use_virtual_table" in {f.name for f in dataclasses.fields(EmbeddingConfig)}
    assert sets(EmbeddingCollectionSharder, "_use_index_dedup")
    for attr in ("_env", "_grouped_embedding_configs"):
        assert sets(BaseTwEmbeddingSharding, attr) or sets(EmbeddingSharding, attr), attr
    assert '"_batch_key"' in inspect.getsource(group_tables)  # a grouping-only fused param (add_grouping_key)
    assert callable(getattr(ShardedEmbeddingCollection, "_embedding_dim_for_sharding_type"))
    assert callable(getattr(ShardedEmbeddingCollection, "_create_input_dist"))
    assert callable(getattr(ShardedEmbeddingCollection, "_pre_load_state_dict_hook"))


def test_storage_reservations_keep_their_share() -> None:
    """TorchRec's percentage storage reservations keep the share of memory they hold back in `_percentage`, which
    storage_reservation_share reads (a rename would silently read 0.0 and plan into that memory)."""
    from torchrec.distributed.planner.storage_reservations import (
        FixedPercentageStorageReservation,
        HeuristicalStorageReservation,
    )

    from embark_torchrec.sharding.torchrec_compat import storage_reservation_share

    for reservation in (FixedPercentageStorageReservation(0.3), HeuristicalStorageReservation(percentage=0.3)):
        assert storage_reservation_share(reservation) == 0.3, type(reservation).__name__


def test_input_exchange_internals_exist() -> None:
    """What input_exchange.py reads through torchrec_compat is where it expects it: an input dist keeps its
    KJTAllToAll in `_dist` (input_dist_all_to_all; DP's has none, and `_dist` is the one TrainPipelineSparseDist
    swaps), a KJTAllToAll its stagger in `_stagger` (kjt_stagger), a KJTSplitsAllToAllMeta its KJT in `_input`
    (split_meta_input); and TorchRec still takes the fields and arguments input_exchange builds its split meta, tensor
    all-to-all and split request with, and its pipeline's fused split exchange passes over awaitables that are not
    split metas (the module's own exchange sends them)."""
    import types

    from torchrec.distributed.dist_data import KJTAllToAll, KJTAllToAllTensorsAwaitable
    from torchrec.distributed.embedding_sharding import (
        FusedKJTListSplitsAwaitable,
        KJTListSplitsAwaitable,
        KJTSplitsAllToAllMeta,
    )
    from torchrec.distributed.sharding.dp_sharding import DpSparseFeaturesDist
    from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
    from torchrec.distributed.sharding.tw_sharding import TwSparseFeaturesDist
    from torchrec.distributed.sharding.twrw_sharding import TwRwSparseFeaturesDist
    from torchrec.distributed.train_pipeline import utils as pipeline_utils
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embark_torchrec.sharding.torchrec_compat import input_dist_all_to_all, kjt_stagger, split_meta_input

    for input_dist in (TwSparseFeaturesDist, RwSparseFeaturesDist, TwRwSparseFeaturesDist):
        assert "self._dist = KJTAllToAll(" in inspect.getsource(input_dist.__init__), input_dist
    assert "_dist" not in inspect.getsource(DpSparseFeaturesDist)
    assert 'hasattr(input_dist, "_dist")' in inspect.getsource(pipeline_utils)
    a2a = KJTAllToAll.__new__(KJTAllToAll)  # no process group needed to tell its type
    assert input_dist_all_to_all(types.SimpleNamespace(_dist=a2a)) is a2a
    assert input_dist_all_to_all(types.SimpleNamespace(_dist=torch.nn.Identity())) is None
    assert input_dist_all_to_all(DpSparseFeaturesDist()) is None

    assert "self._stagger = stagger" in inspect.getsource(KJTAllToAll.__init__)
    assert kjt_stagger(types.SimpleNamespace(_stagger=2)) == 2

    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]))
    meta_fields = {f.name for f in dataclasses.fields(KJTSplitsAllToAllMeta)}  # DeferredKJTAllToAll sets them all
    meta_args = "pg _input splits splits_tensors input_splits input_tensors labels keys device stagger"
    assert meta_fields == set(meta_args.split()), meta_fields
    meta = KJTSplitsAllToAllMeta(**{name: None for name in meta_fields} | {"_input": kjt})
    assert split_meta_input(meta) is kjt
    tensors_args = "pg input splits input_splits output_splits input_tensors labels keys device stagger stride_per_rank"
    assert set(tensors_args.split()) <= set(inspect.signature(KJTAllToAllTensorsAwaitable.__init__).parameters)
    assert list(inspect.signature(KJTListSplitsAwaitable.__init__).parameters)[1:3] == ["awaitables", "ctx"]
    assert "self.awaitables = awaitables" in inspect.getsource(KJTListSplitsAwaitable.__init__)
    assert "if isinstance(awaitable, KJTSplitsAllToAllMeta)" in inspect.getsource(FusedKJTListSplitsAwaitable.__init__)


def test_tiled_sharding_spec_equals_the_spec_torch_validates() -> None:
    """tiled_sharding_spec skips only EnumerableShardingSpec's overlap check: for a grid it equals torch's own."""
    shards = [ShardMetadata([r, c], [2, 4], f"rank:{r + c // 4}/cpu") for r in (0, 2) for c in (0, 4)]
    assert tiled_sharding_spec(shards) == EnumerableShardingSpec(shards)
