"""EMBark sharding under torchrec's TrainPipelineSparseDist: pipelining (input dist of batch i+1 overlapping the
forward/backward of batch i) changes nothing in what the model learns.

One 4-rank spawn (2 nodes x 2). A small dense + EBC model is sharded with EmbarkEmbeddingBagCollectionSharder by a
plan with a grid table on our flat grid sharding, a hierarchical row split across nodes, a data-parallel table and a
table-wise one; the same model is trained once through the pipeline and once with a plain loop, on the same batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embark_torchrec.jobs import measured_window
from embark_torchrec.plan.layout.tables import Plan, TableLayout
from embark_torchrec.sharding.comm_stats import enable_comm_stats
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.testing import copy_global_weights, global_kjt_batch, run_ranks

pytestmark = pytest.mark.torchrec_version

WORLD_SIZE, LOCAL_WORLD_SIZE = 4, 2
STEPS = 4
BATCH_PER_RANK = 6
DENSE_IN = 5
LR = 0.05
SEED = 7

TABLES = [
    EmbeddingBagConfig(name="grid", num_embeddings=40, embedding_dim=16, feature_names=["g0", "g1"]),
    EmbeddingBagConfig(name="hier", num_embeddings=30, embedding_dim=8, feature_names=["h"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="dp", num_embeddings=10, embedding_dim=4, feature_names=["d"]),
    EmbeddingBagConfig(name="tw", num_embeddings=20, embedding_dim=12, feature_names=["t"]),
    EmbeddingBagConfig(name="ub", num_embeddings=24, embedding_dim=8, feature_names=["u"], pooling=PoolingType.MEAN),
]
FEATURES = [f for t in TABLES for f in t.feature_names]
LAYOUTS = {
    "grid": TableLayout("rb", (0, 13, 40), (0, 8, 16), ((0, 1), (3, 2))),
    "hier": TableLayout("rb", (0, 10, 30), (0, 8), ((1,), (2,)), hierarchical=True),
    "dp": TableLayout.data_parallel(),
    "tw": TableLayout.table_wise(20, 12, 3),
    # unique-based: its de-duplication state must stay with its batch while the next batch's input dist runs
    "ub": TableLayout("ub", (0, 9, 24), (0, 4, 8), ((3, 0), (1, 3))),
}


class DenseSparseModel(nn.Module):
    """Pooled embeddings (in a fixed feature order) + a dense projection -> one logit; forward(batch) returns
    (per-sample losses, (losses, logits)) as TrainPipelineSparseDist expects."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=TABLES, device=device)
        self.dense = nn.Linear(DENSE_IN, 6, device=device)
        width = sum(t.embedding_dim * len(t.feature_names) for t in TABLES) + 6
        self.over = nn.Linear(width, 1, device=device)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        pooled = self.ebc(batch.sparse_features).to_dict()
        x = torch.cat([pooled[f] for f in FEATURES] + [torch.relu(self.dense(batch.dense_features))], dim=1)
        logits = self.over(x).squeeze(-1)
        losses = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        return losses, (losses.detach(), logits.detach())


def _sharded(reference: nn.Module) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """The model sharded by LAYOUTS with fused Adagrad, the reference weights copied in, and one optimizer over the
    fused (embedding) and dense parameters."""
    meta = DenseSparseModel(torch.device("meta"))
    spec = ModelSpec.from_module(meta.ebc, batch_size=WORLD_SIZE)
    plan = Plan(WORLD_SIZE, LOCAL_WORLD_SIZE, LAYOUTS)
    sharder = EmbarkEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": 1e-8}
    )
    model = DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"ebc": module_sharding_plan(plan, spec, "cpu")}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )
    copy_global_weights(model, reference)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.SGD(params, lr=LR)
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def _batches(rank: int) -> list[Batch]:
    out = []
    for step in range(STEPS):
        sparse = global_kjt_batch(TABLES, WORLD_SIZE, BATCH_PER_RANK, seed=SEED + 10 * step, ids="zipf")[rank]
        gen = torch.Generator().manual_seed(1000 * step + rank)
        out.append(
            Batch(
                dense_features=torch.randn(BATCH_PER_RANK, DENSE_IN, generator=gen),
                sparse_features=sparse,
                labels=torch.randint(0, 2, (BATCH_PER_RANK,), generator=gen).float(),
            )
        )
    return out


def _weights(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Every weight this rank holds: the local shards of sharded tables, whole tensors otherwise."""
    out: dict[str, list[torch.Tensor]] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            out[key] = [s.tensor.detach().clone() for s in value.local_shards()]
        else:
            out[key] = [value.detach().clone()]
    return out


def _pipelined_vs_plain() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    reference = DenseSparseModel(torch.device("cpu"))
    batches = _batches(rank)

    plain, plain_opt = _sharded(reference)
    plain_stats = enable_comm_stats(plain)
    initial = _weights(plain)
    plain_losses, plain_logits = [], []
    for batch in batches:
        plain_opt.zero_grad()
        losses, (_, logits) = plain(batch)
        losses.sum().backward()
        plain_opt.step()
        plain_losses.append(losses.detach())
        plain_logits.append(logits)

    piped, piped_opt = _sharded(reference)
    piped_stats = enable_comm_stats(piped)
    pipeline = TrainPipelineSparseDist(piped, piped_opt, torch.device("cpu"), execute_all_batches=True)
    iterator = iter(batches)
    piped_losses, piped_logits, ids_sent = [], [], []
    while True:
        try:
            losses, logits = pipeline.progress(iterator)
        except StopIteration:
            break
        piped_losses.append(losses)
        piped_logits.append(logits)
        ids_sent.append(piped_stats.by("kind").get("ids", {}).get("sent", 0))
    pipelined_modules = [type(m).__name__ for m in pipeline._pipelined_modules]

    plain_w, piped_w = _weights(plain), _weights(piped)
    return {
        "pipelined_modules": pipelined_modules,
        "steps": (len(plain_losses), len(piped_losses)),
        "loss_diff": [float((a - b).abs().max()) for a, b in zip(plain_losses, piped_losses)],
        "logit_diff": [float((a - b).abs().max()) for a, b in zip(plain_logits, piped_logits)],
        "losses": [float(loss.sum()) for loss in plain_losses],
        "weight_keys": (sorted(plain_w), sorted(piped_w)),
        "weight_diff": {
            k: max((float((a - b).abs().max()) for a, b in zip(plain_w[k], piped_w[k]) if a.numel()), default=0.0)
            for k in plain_w
        },
        "shards": {k: len(v) for k, v in plain_w.items()},
        "ids_sent_by_step": np.diff(ids_sent, prepend=0).tolist(),
        "bytes": [{str(k): s.per_peer(k).tolist() for k in s.keys()} for s in (plain_stats, piped_stats)],
        "trained": {
            k: max((float((a - b).abs().max()) for a, b in zip(initial[k], plain_w[k]) if a.numel()), default=0.0)
            for k in plain_w
        },
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_pipelined_vs_plain, WORLD_SIZE, local_world_size=LOCAL_WORLD_SIZE, timeout_s=300)


def test_pipeline_really_pipelines_the_embark_module(results: list[dict[str, Any]]) -> None:
    """The pipeline found our sharded EBC as its pipelined module and ran all K steps (no batch dropped or added)."""
    for rank, r in enumerate(results):
        assert r["pipelined_modules"] == ["EmbarkShardedEmbeddingBagCollection"], rank
        assert r["steps"] == (STEPS, STEPS), rank


def test_pipelined_losses_equal_plain_losses(results: list[dict[str, Any]]) -> None:
    """Per-sample losses and logits of every step equal those of plain (non-pipelined) training, on every rank."""
    for rank, r in enumerate(results):
        assert len(r["loss_diff"]) == STEPS and len(r["logit_diff"]) == STEPS
        assert max(r["loss_diff"]) <= 1e-6, (rank, r["loss_diff"])
        assert max(r["logit_diff"]) <= 1e-6, (rank, r["logit_diff"])
        # training moved: the loss is not the same at every step
        assert len({round(loss, 6) for loss in r["losses"]}) > 1, (rank, r["losses"])


def test_pipelined_bytes_equal_plain_bytes(results: list[dict[str, Any]]) -> None:
    """Communication counting sees the same bytes per cluster, table, kind and peer with and without the pipeline
    (which fuses TorchRec's split exchanges and builds the KJT all-to-alls itself)."""
    for rank, r in enumerate(results):
        plain, piped = r["bytes"]
        assert plain == piped, rank
        assert any("'ids'" in k and "embark_ub" in k for k in plain) and any(
            "'ids'" in k and "table_wise" in k for k in plain
        )


def test_measured_window_counts_only_steps_that_distribute_a_batch(results: list[dict[str, Any]]) -> None:
    """Every step the examples' throughput counts (jobs.measured_window, after one warm-up step) sends a batch's IDs,
    as a steady step does; the pipeline's last step sends none (it has no next batch), and the window leaves it out:
    counted, it made plans that send many IDs look faster than they run."""
    after, through = measured_window(STEPS, 1, pipelined=True)
    assert through < STEPS
    for rank, r in enumerate(results):
        sent = r["ids_sent_by_step"]
        assert len(sent) == STEPS and sent[-1] == 0, (rank, sent)
        assert all(n > 0 for n in sent[after:through]), (rank, sent)


def test_pipelined_weights_equal_plain_weights(results: list[dict[str, Any]]) -> None:
    """After K steps every weight (each local shard of the grid, hierarchical and table-wise tables, the DP table
    and the dense layers) equals plain training's; and those weights did change during training."""
    expected = {f"ebc.embedding_bags.{t.name}.weight" for t in TABLES} | {
        "dense.weight",
        "dense.bias",
        "over.weight",
        "over.bias",
    }
    held = {k: 0 for k in expected}
    for rank, r in enumerate(results):
        plain_keys, piped_keys = r["weight_keys"]
        assert set(plain_keys) == expected and plain_keys == piped_keys, (rank, plain_keys)
        bad = {k: v for k, v in r["weight_diff"].items() if not v <= 1e-6}
        assert not bad, (rank, bad)
        for k, n in r["shards"].items():
            held[k] += n
    # not vacuous: the shards held across ranks are the plan's cells, and training changed every table
    assert held["ebc.embedding_bags.grid.weight"] == 4 and held["ebc.embedding_bags.hier.weight"] == 2
    assert held["ebc.embedding_bags.tw.weight"] == 1 and held["ebc.embedding_bags.ub.weight"] == 4
    for t in TABLES:
        key = f"ebc.embedding_bags.{t.name}.weight"
        assert max(r["trained"][key] for r in results) > 1e-4, key


def test_measured_window_without_the_pipeline_and_on_short_runs() -> None:
    """A plain loop's last step is a steady one, so it is counted; the warm-up is left out; every run measures at
    least one step, however short."""
    assert measured_window(25, 10, pipelined=False) == (10, 25)
    assert measured_window(25, 10, pipelined=True) == (10, 24)
    for steps in range(1, 6):
        for pipelined in (False, True):
            after, through = measured_window(steps, 10, pipelined)
            assert 0 <= after < through <= steps, (steps, pipelined)
