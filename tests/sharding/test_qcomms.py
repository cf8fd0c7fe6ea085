"""A sharder's QCommsConfig applies to our sharding types as to TorchRec's: with fp16 qcomms and no precision in the
plan, an embark grid sends its embeddings and gradients at fp16 (half the counted bytes of the same step without
qcomms, outputs within fp16 rounding of the fp32 run); a precision the plan sets wins over the QCommsConfig. Any
other codec a QCommsConfig (or a user) gives runs on our dists as given: test_foreign_codecs.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.layout.tables import Plan, TableLayout, WirePrecision
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.sharding.comm_stats import enable_comm_stats
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.training import SparseArch

pytestmark = pytest.mark.torchrec_version

TABLES = [
    EmbeddingBagConfig(name="g", num_embeddings=40, embedding_dim=8, feature_names=["g0"]),
    EmbeddingBagConfig(name="p", num_embeddings=30, embedding_dim=8, feature_names=["p0"]),
]


def _registry(precision: CommType) -> Any:
    return get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=precision, backward_precision=precision), device=torch.device("cpu")
    )


def _step(qcomms: bool) -> dict[str, Any]:
    layouts = {
        "g": TableLayout("rb", (0, 15, 40), (0, 8), ((0,), (1,))),  # no precision in the plan: the sharder's applies
        "p": TableLayout("rb", (0, 12, 30), (0, 8), ((1,), (0,)), WirePrecision("fp8", "fp8")),  # the plan's wins
    }
    torch.manual_seed(0)
    meta = SparseArch(TABLES, False, torch.device("meta"))
    spec = ModelSpec.from_module(meta.ebc, batch_size=2)
    sharder = EmbarkEmbeddingBagCollectionSharder(
        fused_params={"learning_rate": 0.1}, qcomm_codecs_registry=_registry(CommType.FP16) if qcomms else None
    )
    model = DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"ebc": module_sharding_plan(Plan(2, 2, layouts), spec, "cpu")}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )
    stats = enable_comm_stats(model)
    out = model(global_kjt_batch(TABLES, 2, 8, seed=1)[dist.get_rank()])
    out = (out.wait() if hasattr(out, "wait") else out).to_dict()
    sum(v.sum() for v in out.values()).backward()
    by_table = {
        t: sum(stats.totals(k for k in stats.keys() if k.table == t and k.kind == "embeddings").values())
        for t in ("g", "p")
    }
    return {"bytes": by_table, "out": {k: v.detach() for k, v in out.items()}}


def _run() -> dict[str, Any]:
    return {"fp32": _step(False), "fp16": _step(True)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_run, 2, timeout_s=240)


def test_qcomms_halve_the_bytes_of_a_cluster_the_plan_leaves_at_fp32(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["fp16"]["bytes"]["g"] * 2 == r["fp32"]["bytes"]["g"] > 0
        assert r["fp16"]["bytes"]["p"] == r["fp32"]["bytes"]["p"] > 0  # the plan's fp8 wins
        ref, got = r["fp32"]["out"]["g0"], r["fp16"]["out"]["g0"]
        assert not torch.equal(ref, got)  # fp16 really applied
        # partial sums rounded to fp16 (2^-11 relative) before they add up: a few roundings of the largest value
        torch.testing.assert_close(got, ref, rtol=2.0**-9, atol=2.0**-9 * float(ref.abs().max()))
