"""The README quick start, as written: EmbarkPlanner + EmbarkEmbeddingBagCollectionSharder in DMP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embark_torchrec import EmbarkEmbeddingBagCollectionSharder, EmbarkPlanner, load_plan
from embark_torchrec.testing import assert_matches_unsharded, copy_global_weights, global_kjt_batch, run_ranks

TABLES = [
    EmbeddingBagConfig(name="t20", embedding_dim=32, num_embeddings=5000, feature_names=["f20"]),
    EmbeddingBagConfig(name="small", embedding_dim=16, num_embeddings=10, feature_names=["g"]),
    EmbeddingBagConfig(name="mid", embedding_dim=16, num_embeddings=800, feature_names=["h1", "h2"]),
]


def _quickstart(plan_path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(tables=TABLES, device=torch.device("cpu"))
    model = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    sharder = EmbarkEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.01})
    planner = EmbarkPlanner(
        batch_size=64,
        hardware="cpu-gloo",
        constraints={"t20": ParameterConstraints(pooling_factors=[100.0])},
    )
    plan = planner.collective_plan(model, [sharder])
    if dist.get_rank() == 0:  # the rank that planned keeps the details
        print(planner.report())  # per rank: memory, lookups, traffic; for every planned module
        (planned,) = planner.plans.values()  # one per EmbeddingBagCollection, keyed by its path
        planned.plan.save(plan_path)  # the plan file
    dist.barrier()
    reloaded = load_plan(plan_path, model)
    sharded = DistributedModelParallel(model, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    copy_global_weights(sharded, reference)
    batch = global_kjt_batch(TABLES, dist.get_world_size(), 8, seed=3)[dist.get_rank()]
    diffs = assert_matches_unsharded(sharded, reference, batch)
    return {
        "plan": str(plan),
        "reloaded": str(reloaded),
        "diffs": diffs,
        "types": sorted({ps.sharding_type for ps in plan.plan[""].values()}),
    }


def test_readme_quick_start_runs_and_matches_unsharded(tmp_path: Path) -> None:
    """Planning collectively gives every rank the same plan, the saved plan file loads back to the same
    ShardingPlan, and the sharded model's outputs equal the unsharded model's."""
    results = run_ranks(_quickstart, 2, timeout_s=240, args=(str(tmp_path / "plan.json"),))
    assert results[0]["plan"] == results[1]["plan"]
    assert all(r["reloaded"] == r["plan"] for r in results)
    for r in results:
        assert sorted(r["diffs"]) == ["f20", "g", "h1", "h2"]
        assert max(r["diffs"].values()) <= 1e-5
