"""Sharded sequence embeddings under TorchRec's TrainPipelineSparseDist learn what a plain loop and an unsharded
EmbeddingCollection learn: the pipeline runs batch i+1's input dist while batch i trains, so each batch's per-batch
state of our grid and unique-based dists must stay with its own context.

One 2-rank spawn. An EC (fused SGD) with a grid table (uneven rows, two column slices, two features), a UB table and
a table-wise one trains K steps through the pipeline and K steps in a plain loop, on the same batches (Zipf IDs,
empty sequences); an unsharded EmbeddingCollection trains on the mean of the ranks' losses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from embark_torchrec.plan.layout.tables import Plan, TableLayout
from embark_torchrec.planner.parameter_sharding import sequence_sharding_plan
from embark_torchrec.sharding.sharded_ec import EmbarkEmbeddingCollectionSharder
from embark_torchrec.testing import copy_global_weights, global_kjt_batch, run_ranks
from embark_torchrec.testing.training import OPTIMIZERS, _reference_optimizer

pytestmark = pytest.mark.torchrec_version

WS, LWS, STEPS, BATCH, DIM, LR = 2, 2, 4, 4, 8, 0.1
TABLES = [
    EmbeddingConfig(name="grid", num_embeddings=40, embedding_dim=DIM, feature_names=["g0", "g1"]),
    EmbeddingConfig(name="ub", num_embeddings=24, embedding_dim=DIM, feature_names=["u"]),
    EmbeddingConfig(name="tw", num_embeddings=20, embedding_dim=DIM, feature_names=["t"]),
]
FEATURES = [f for t in TABLES for f in t.feature_names]
LAYOUTS = {
    "grid": TableLayout("rb", (0, 13, 40), (0, 4, DIM), ((0, 1), (1, 0))),
    "ub": TableLayout("ub", (0, 9, 24), (0, DIM), ((1,), (0,))),
    "tw": TableLayout.table_wise(20, DIM, 1),
}


class SequenceLoss(nn.Module):
    """An EC and a fixed projection per feature: loss = sum over IDs of (vector . projection)^2; forward(batch)
    returns (loss, (per-feature vectors, lengths)) as TrainPipelineSparseDist expects."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=TABLES, device=device)
        gen = torch.Generator().manual_seed(3)
        self.register_buffer("projection", torch.randn(len(FEATURES), DIM, generator=gen))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        out = self.ec(batch.sparse_features)
        out = out.wait() if hasattr(out, "wait") else out
        loss = sum(((out[f].values() @ self.projection[i]) ** 2).sum() for i, f in enumerate(FEATURES))
        return loss, {f: (out[f].values().detach(), out[f].lengths()) for f in FEATURES}  # type: ignore[return-value]


def _batches(rank: int) -> list[list[Batch]]:
    """Per step, every rank's batch (the reference trains on all of them)."""
    out = []
    for step in range(STEPS):
        sparse = global_kjt_batch(TABLES, WS, BATCH, seed=20 + step, ids="zipf")
        out.append(
            [Batch(dense_features=torch.zeros(BATCH, 1), sparse_features=s, labels=torch.zeros(BATCH)) for s in sparse]
        )
    return out


def _sharded() -> DistributedModelParallel:
    """The whole model sharded by LAYOUTS (fused SGD), as a trainer hands it to the pipeline."""
    meta = SequenceLoss(torch.device("meta"))
    sharder = EmbarkEmbeddingCollectionSharder(fused_params={"optimizer": OPTIMIZERS["sgd"], "learning_rate": LR})
    return DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"ec": sequence_sharding_plan(Plan(WS, LWS, LAYOUTS), meta.ec, "cpu")}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )


def _max_diff(
    a: dict[str, tuple[torch.Tensor, torch.Tensor]], b: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """Largest |a - b| over the per-feature vectors; inf if any lengths differ."""
    worst = 0.0
    for f in FEATURES:
        if not torch.equal(a[f][1], b[f][1]) or a[f][0].shape != b[f][0].shape:
            return float("inf")
        if a[f][0].numel():
            worst = max(worst, float((a[f][0] - b[f][0]).abs().max()))
    return worst


def _pipelined_plain_unsharded() -> dict[str, Any]:
    rank = dist.get_rank()
    batches = _batches(rank)

    torch.manual_seed(0)
    reference = SequenceLoss(torch.device("cpu"))
    plain = _sharded()
    copy_global_weights(plain, reference)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    ref_opt = _reference_optimizer(list(reference.ec.named_parameters()), "sgd", LR, LAYOUTS)
    plain_out, ref_out = [], []
    for step_batches in batches:
        loss, out = plain(step_batches[rank])
        loss.backward()  # the fused optimizer steps in backward
        plain_out.append(out)
        ref_opt.zero_grad()
        ref_loss = torch.zeros(())
        for r, b in enumerate(step_batches):
            loss, out = reference(b)
            ref_loss = ref_loss + loss
            if r == rank:
                ref_out.append(out)
        (ref_loss / WS).backward()
        ref_opt.step()

    piped = _sharded()
    copy_global_weights(piped, initial)
    pipeline = TrainPipelineSparseDist(piped, piped.fused_optimizer, torch.device("cpu"), execute_all_batches=True)
    iterator = iter([b[rank] for b in batches])
    piped_out = []
    while True:
        try:
            piped_out.append(pipeline.progress(iterator))
        except StopIteration:
            break
    full = reference.state_dict()
    weights = {}
    for name, model in (("plain", plain), ("piped", piped)):
        worst = 0.0
        for key, value in model.state_dict().items():
            pieces = (
                [(s.metadata.shard_offsets, s.tensor) for s in value.local_shards()]
                if isinstance(value, ShardedTensor)
                else [((0,) * value.dim(), value)]
            )
            for offsets, tensor in pieces:
                region = full[key]
                for d, (off, size) in enumerate(zip(offsets, tensor.shape)):
                    region = region.narrow(d, off, size)
                if tensor.numel():
                    worst = max(worst, float((tensor - region).abs().max()))
        weights[name] = worst
    return {
        "pipelined_modules": [type(m).__name__ for m in pipeline._pipelined_modules],
        "steps": (len(plain_out), len(piped_out)),
        "piped_vs_plain": [_max_diff(a, b) for a, b in zip(piped_out, plain_out)],
        "plain_vs_unsharded": [_max_diff(a, b) for a, b in zip(plain_out, ref_out)],
        "weights_vs_unsharded": weights,
        "moved": max(float((full[k] - v).abs().max()) for k, v in initial.items()),
        "ids": [int(b[rank].sparse_features.values().numel()) for b in batches],
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_pipelined_plain_unsharded, WS, local_world_size=LWS, timeout_s=300)


def test_pipelined_sequence_training_equals_plain_and_unsharded(results: list[dict[str, Any]]) -> None:
    """The pipeline pipelines our sharded EC and runs all K steps; at every step each feature's vectors (and
    lengths) through the pipeline equal the plain loop's (1e-6) and the unsharded EC's (1e-5); after K steps every
    local cell of the grid, UB and table-wise tables equals the unsharded EC's weights, for both loops; and those
    weights moved."""
    for rank, r in enumerate(results):
        assert r["pipelined_modules"] == ["EmbarkShardedEmbeddingCollection"], rank
        assert r["steps"] == (STEPS, STEPS), rank
        assert len(r["piped_vs_plain"]) == STEPS and max(r["piped_vs_plain"]) <= 1e-6, (rank, r["piped_vs_plain"])
        assert max(r["plain_vs_unsharded"]) <= 1e-5, (rank, r["plain_vs_unsharded"])
        assert all(v <= 1e-5 for v in r["weights_vs_unsharded"].values()), (rank, r["weights_vs_unsharded"])
        assert all(n > 0 for n in r["ids"]), rank
        assert r["moved"] > 1e-3, rank  # training changed the weights
