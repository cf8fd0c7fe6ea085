"""Sharded sequence embeddings (EmbeddingCollection) train like unsharded ones: outputs and weights, step by step.

Run `compare_sharded_sequence_training` inside every rank (e.g. with run_ranks), as training.py's
compare_sharded_training for bags: same global batch, same optimizer, the reference trains on the mean of
the per-rank losses (TorchRec divides embedding gradients by the world size).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from ..plan.layout.tables import Plan, TableLayout
from ..planner.parameter_sharding import sequence_sharding_plan
from ..sharding.sharded_ec import EmbarkEmbeddingCollectionSharder
from .batches import global_kjt_batch
from .equality import copy_global_weights
from .training import ADAGRAD_EPS, OPTIMIZERS, _reference_optimizer, weight_diffs


class SequenceArch(nn.Module):
    """The collection under an attribute, as in real models, so plans address it as "ec"."""

    def __init__(self, tables: list[EmbeddingConfig], device: torch.device) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=tables, device=device)

    def forward(self, features: KeyedJaggedTensor) -> Any:
        return self.ec(features)


def sharded_sequence_model(
    tables: list[EmbeddingConfig],
    layouts: Mapping[str, TableLayout],
    local_world_size: int,
    optimizer: str = "sgd",
    lr: float = 0.1,
    invalid_ids: str = "raise",
    pg: dist.ProcessGroup | None = None,
) -> DistributedModelParallel:
    """A SequenceArch sharded by `layouts` through EmbarkEmbeddingCollectionSharder, on `pg` (the default group
    unless given)."""
    pg = pg or dist.group.WORLD
    ws = dist.get_world_size(pg)
    meta = SequenceArch(tables, torch.device("meta"))
    plan = Plan(ws, local_world_size, dict(layouts))
    sharder = EmbarkEmbeddingCollectionSharder(
        fused_params={"optimizer": OPTIMIZERS[optimizer], "learning_rate": lr, "eps": ADAGRAD_EPS},
        invalid_ids=invalid_ids,
    )
    return DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(pg),
        plan=ShardingPlan({"ec": sequence_sharding_plan(plan, meta.ec, "cpu")}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )


def _as_jagged(output: Any) -> dict[str, JaggedTensor]:
    return dict(output.wait() if hasattr(output, "wait") else output)


def _loss(output: Mapping[str, JaggedTensor], projection: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Each ID's vector against its own random projection, squared: a loss whose gradient depends on
    which vector sits at which position."""
    return sum(((output[k].values() * projection[k]).sum(dim=1) ** 2).sum() for k in sorted(projection))  # type: ignore[return-value]


def compare_sharded_sequence_training(
    tables: list[EmbeddingConfig],
    layouts: Mapping[str, TableLayout],
    local_world_size: int,
    steps: int = 2,
    optimizer: str = "sgd",
    batch_per_rank: int = 4,
    seed: int = 0,
    lr: float = 0.1,
    silent_rank: int | None = None,
    ids: str = "uniform",
    model: DistributedModelParallel | None = None,
) -> dict[str, float]:
    """Max |sharded - unsharded| per output feature (each step: vectors, and lengths) and per table weight
    (after all steps). `silent_rank` sends no IDs at all; `ids` as in global_kjt_batch; `model`: an already
    sharded model of these tables (built here when None)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = SequenceArch(tables, torch.device("cpu"))
    if model is None:
        model = sharded_sequence_model(tables, layouts, local_world_size, optimizer, lr)
    copy_global_weights(model, reference)
    ref_opt = _reference_optimizer(list(reference.named_parameters()), optimizer, lr, layouts)
    diffs: dict[str, float] = {}
    for step in range(steps):
        batch = global_kjt_batch(tables, ws, batch_per_rank, seed=seed + 100 * step, ids=ids)
        if silent_rank is not None:
            batch[silent_rank] = KeyedJaggedTensor.from_lengths_sync(
                keys=batch[silent_rank].keys(),
                values=batch[silent_rank].values()[:0],
                lengths=torch.zeros_like(batch[silent_rank].lengths()),
            )
        gen = torch.Generator().manual_seed(seed + step)
        dim = tables[0].embedding_dim
        projections = [
            {k: torch.randn(n, dim, generator=gen) for k, n in zip(b.keys(), b.length_per_key())} for b in batch
        ]
        ref_opt.zero_grad()
        ref_loss = torch.zeros(())
        ref_out_here: dict[str, JaggedTensor] = {}
        for r in range(ws):
            out = reference(batch[r])
            ref_loss = ref_loss + _loss(out, projections[r])
            if r == rank:
                ref_out_here = out
        (ref_loss / ws).backward()
        ref_opt.step()
        out = _as_jagged(model(batch[rank]))
        _loss(out, projections[rank]).backward()
        for k, want in ref_out_here.items():
            got = out[k]
            same_lengths = torch.equal(got.lengths(), want.lengths())
            values = (got.values().detach() - want.values().detach()).abs()
            worst = float(values.max()) if values.numel() else 0.0
            diffs[f"step{step}/{k}"] = (
                worst if same_lengths and got.values().shape == want.values().shape else float("inf")
            )
    diffs.update(weight_diffs(model, reference.state_dict()))
    return diffs
