"""DDP's all-reduce precision reaches DMP as a plan says, for the dense part and the data-parallel tables:
sharding.data_parallel.data_parallel_wrapper (the bytes it sends are checked against the kernel's link counters in
tests/e2e/test_cluster.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.sharding.data_parallel import data_parallel_wrapper, sharded_module_ddps
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.training import SparseArch

pytestmark = pytest.mark.torchrec_version


def test_wrapper_takes_the_plans_precision_and_refuses_what_ddp_cannot_run() -> None:
    """A plan's data-parallel tables travel in DDP's buckets with the dense part: one precision, named otherwise."""
    same = Plan(2, 2, {"t": TableLayout.data_parallel(WirePrecision("fp32", "fp16"))}, {}, "fp16")
    assert isinstance(data_parallel_wrapper(same), DefaultDataParallelWrapper)
    other = Plan(2, 2, {"t": TableLayout.data_parallel(WirePrecision("fp32", "bf16"))}, {}, "fp16")
    with pytest.raises(PlanError, match="table 't'.*bf16.*fp16"):
        data_parallel_wrapper(other)
    with pytest.raises(ValueError, match="fp8"):
        data_parallel_wrapper("fp8")


TABLES = [
    EmbeddingBagConfig(name="dp", num_embeddings=40, embedding_dim=8, feature_names=["d0"]),
    EmbeddingBagConfig(name="tw", num_embeddings=30, embedding_dim=8, feature_names=["t0"]),
]


def _data_parallel_grads(precision: str) -> list[torch.Tensor]:
    """One step of a data-parallel and a table-wise table under data_parallel_wrapper(precision): the gradients
    DDP left on the data-parallel table's weights (rank-specific batches, so the all-reduce has work to do)."""
    meta = SparseArch(TABLES, False, torch.device("meta"))
    spec = ModelSpec.from_module(meta.ebc, batch_size=2)
    layouts = {
        "dp": TableLayout.data_parallel(WirePrecision("fp32", precision)),
        "tw": TableLayout.table_wise(30, 8, 1),
    }
    plan = Plan(2, 2, layouts, {}, precision)
    model = DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"ebc": module_sharding_plan(plan, spec, "cpu")}),
        sharders=[EmbarkEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})],
        device=torch.device("cpu"),
        data_parallel_wrapper=data_parallel_wrapper(plan),
    )
    ddps = sharded_module_ddps(model)
    assert len(ddps) == 1, ddps  # TorchRec's DDP of the data-parallel sharding
    out = model(global_kjt_batch(TABLES, 2, 16, seed=3)[dist.get_rank()])
    out = (out.wait() if hasattr(out, "wait") else out).to_dict()
    torch.manual_seed(7 + dist.get_rank())
    sum((v * torch.randn_like(v)).sum() for v in out.values()).backward()
    return [p.grad.detach().clone() for p in ddps[0].parameters() if p.grad is not None]


def test_data_parallel_tables_all_reduce_at_the_plans_precision() -> None:
    """TorchRec gives a data-parallel sharding a DDP of its own, which DMP's DDP (the one TorchRec's wrapper hooks)
    leaves out: at fp16 its averaged gradients must come back from fp16 (every element an fp16 value), the same on
    every rank; at fp32 they are not fp16 values."""
    for precision, fp16_values in (("fp16", True), ("fp32", False)):
        ranks = run_ranks(_data_parallel_grads, 2, args=(precision,))
        assert ranks[0] and len(ranks[0]) == len(ranks[1])
        for g0, g1 in zip(*ranks):
            assert torch.equal(g0, g1)
            assert g0.abs().sum() > 0
            assert torch.equal(g0, g0.half().float()) == fp16_values, precision
