"""Smoke test of the stack we build on: stock TorchRec sharding through DMP on 2 gloo ranks matches an unsharded model.

If this fails, the environment (torch / torchrec / fbgemm-gpu-cpu) or the equality helpers are broken, not our code.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.testing import assert_matches_unsharded, copy_global_weights, global_kjt_batch, run_ranks

pytestmark = pytest.mark.torchrec_version

WORLD_SIZE = 2
BATCH_PER_RANK = 5
SEED = 1234
FUSED = EmbeddingComputeKernel.FUSED.value

TABLES = [
    EmbeddingBagConfig(
        name="t0", embedding_dim=16, num_embeddings=40, feature_names=["f0", "f1"], pooling=PoolingType.SUM
    ),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=25, feature_names=["f2"], pooling=PoolingType.SUM),
    EmbeddingBagConfig(name="t2", embedding_dim=32, num_embeddings=60, feature_names=["f3"], pooling=PoolingType.SUM),
]
FEATURES = [name for table in TABLES for name in table.feature_names]

# Table-wise puts t0/t2 on rank 0 and t1 on rank 1, so both ranks own something and outputs need the all-to-all.
PLANS = {
    "table_wise": {
        "t0": table_wise(rank=0, compute_kernel=FUSED),
        "t1": table_wise(rank=1, compute_kernel=FUSED),
        "t2": table_wise(rank=0, compute_kernel=FUSED),
    },
    "column_wise": {name: column_wise(ranks=[0, 1], compute_kernel=FUSED) for name in ("t0", "t1", "t2")},
}


class SparseModel(nn.Module):
    """The EBC under an attribute, as in real models, so the plan is addressed by module path ("ebc")."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=TABLES, device=device)

    def forward(self, features: KeyedJaggedTensor) -> Any:
        return self.ebc(features)


def _local_shards(model: nn.Module) -> dict[str, list[tuple[list[int], list[int]]]]:
    layout: dict[str, list[tuple[list[int], list[int]]]] = {}
    for key, value in model.state_dict().items():
        assert isinstance(value, ShardedTensor), f"{key} is not sharded: {type(value).__name__}"
        layout[key] = [(list(s.metadata.shard_offsets), list(s.metadata.shard_sizes)) for s in value.local_shards()]
    return layout


def _shard_and_compare() -> dict[str, dict[str, Any]]:
    """In each rank: shard with each plan, load the reference weights, compare outputs on this rank's slice."""
    rank = dist.get_rank()
    torch.manual_seed(SEED)  # the same reference weights on every rank
    reference = SparseModel(torch.device("cpu"))
    local_batch = global_kjt_batch(TABLES, WORLD_SIZE, BATCH_PER_RANK, seed=SEED)[rank]
    sharder = EmbeddingBagCollectionSharder()
    report: dict[str, dict[str, Any]] = {}
    for plan_name, per_table in PLANS.items():
        meta_model = SparseModel(torch.device("meta"))
        module_plan = construct_module_sharding_plan(
            meta_model.ebc, per_table, sharder=sharder, local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu"
        )
        sharded = DistributedModelParallel(
            meta_model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            plan=ShardingPlan({"ebc": module_plan}),
            sharders=[sharder],
            device=torch.device("cpu"),
        )
        copied = copy_global_weights(sharded, reference)
        max_diff = assert_matches_unsharded(sharded, reference, local_batch, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            reference_norms = {key: float(t.abs().sum()) for key, t in reference(local_batch).to_dict().items()}
        report[plan_name] = {
            "copied": copied,
            "max_diff": max_diff,
            "reference_norms": reference_norms,
            "local_shards": _local_shards(sharded),
            "empty_bags": int((local_batch.lengths() == 0).sum()),
        }
    return report


def test_stock_sharding_matches_unsharded_on_two_gloo_ranks() -> None:
    """Property: TW and CW sharded EBC outputs equal the unsharded model's per feature (atol 1e-5) on every rank."""
    reports = run_ranks(_shard_and_compare, WORLD_SIZE, timeout_s=240)
    assert len(reports) == WORLD_SIZE
    weight_keys = sorted(f"ebc.embedding_bags.{t.name}.weight" for t in TABLES)
    for rank, report in enumerate(reports):
        assert sorted(report) == sorted(PLANS)
        for plan_name, result in report.items():
            # Guard against a vacuous pass: every feature compared, on non-zero outputs, with empty bags present.
            assert sorted(result["copied"]) == weight_keys
            assert sorted(result["max_diff"]) == sorted(FEATURES), (rank, plan_name)
            assert all(diff <= 1e-5 for diff in result["max_diff"].values()), (rank, plan_name, result["max_diff"])
            assert all(norm > 0 for norm in result["reference_norms"].values()), (rank, plan_name)
            assert result["empty_bags"] >= len(FEATURES)
    # The plans were really applied: check which shards each rank holds.
    tw = [r["table_wise"]["local_shards"] for r in reports]
    assert tw[0]["ebc.embedding_bags.t0.weight"] == [([0, 0], [40, 16])]
    assert tw[1]["ebc.embedding_bags.t0.weight"] == []
    assert tw[1]["ebc.embedding_bags.t1.weight"] == [([0, 0], [25, 8])]
    assert tw[0]["ebc.embedding_bags.t1.weight"] == []
    cw = [r["column_wise"]["local_shards"] for r in reports]
    for table in TABLES:
        key = f"ebc.embedding_bags.{table.name}.weight"
        half = table.embedding_dim // 2
        assert cw[0][key] == [([0, 0], [table.num_embeddings, half])]
        assert cw[1][key] == [([0, half], [table.num_embeddings, half])]
