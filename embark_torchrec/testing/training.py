"""Sharded training equals unsharded training: outputs and weights, step by step.

Run `compare_sharded_training` inside every rank (e.g. with run_ranks). It shards an
EmbeddingBagCollection by a plan, copies the reference weights in, and trains both on the same
global batch with the same optimizer. TorchRec averages embedding gradients over ranks (its
all-to-all backward divides by the world size, as DDP does for DP tables), so the reference
trains on the mean of the per-rank losses.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, get_embedding_names_by_table
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..plan.layout.tables import Plan, TableLayout
from ..planner.parameter_sharding import module_sharding_plan
from ..plan.model.spec import ModelSpec
from ..sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from .batches import global_kjt_batch
from .equality import copy_global_weights

ADAGRAD_EPS = 1e-8
OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


class SparseArch(nn.Module):
    """The collection under an attribute, as in real models, so plans address it as "ebc"."""

    def __init__(self, tables: list[EmbeddingBagConfig], weighted: bool, device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=device)

    def forward(self, features: KeyedJaggedTensor) -> Any:
        return self.ebc(features)


class RowwiseAdagrad(torch.optim.Optimizer):
    """fbgemm's EXACT_ROWWISE_ADAGRAD, unsharded: one accumulator per row and column slice (a sharded
    table keeps one per row of each cell, as TorchRec's column-wise sharding does), which adds the
    mean squared gradient over the slice's columns; the step divides by its root."""

    def __init__(self, params: Any, col_bounds: list[tuple[int, ...]], lr: float, eps: float) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})
        self._col_bounds = col_bounds

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        for p, bounds in zip(params, self._col_bounds):
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum1"] = torch.zeros(p.size(0), len(bounds) - 1, dtype=p.dtype)
            group = self.param_groups[0]
            for c, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                g = p.grad[:, lo:hi]
                state["momentum1"][:, c] += g.pow(2).mean(dim=1)
                p[:, lo:hi] -= group["lr"] * g / (state["momentum1"][:, c : c + 1].sqrt() + group["eps"])


def _reference_optimizer(
    named: list[tuple[str, torch.nn.Parameter]], name: str, lr: float, layouts: Mapping[str, TableLayout]
) -> torch.optim.Optimizer:
    params = [p for _, p in named]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "rowwise_adagrad":
        tables = [key.split(".")[-2] for key, _ in named]  # "...embedding_bags.<table>.weight"
        bounds = [
            tuple(layouts[t].col_bounds) if t in layouts and layouts[t].col_bounds else (0, p.size(1))
            for t, p in zip(tables, params)
        ]
        return RowwiseAdagrad(params, bounds, lr, ADAGRAD_EPS)
    return torch.optim.Adagrad(params, lr=lr, eps=ADAGRAD_EPS)


def _loss(output: Mapping[str, torch.Tensor], projection: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return sum((output[k] * projection[k]).sum() for k in sorted(projection))  # type: ignore[return-value]


def sharded_model(
    tables: list[EmbeddingBagConfig],
    layouts: Mapping[str, TableLayout],
    local_world_size: int,
    weighted: bool = False,
    optimizer: str = "sgd",
    lr: float = 0.1,
    invalid_ids: str = "raise",
    unique_lookup: str = "auto",
    pg: dist.ProcessGroup | None = None,
    qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
) -> DistributedModelParallel:
    """A SparseArch sharded by `layouts` through EmbarkEmbeddingBagCollectionSharder, on `pg` (the default group
    unless given, e.g. one with a short timeout), with the sharder's `qcomm_codecs_registry` (QCommsConfig's)."""
    pg = pg or dist.group.WORLD
    ws = dist.get_world_size(pg)
    meta = SparseArch(tables, weighted, torch.device("meta"))
    plan = Plan(ws, local_world_size, dict(layouts))
    spec = ModelSpec.from_module(meta.ebc, batch_size=ws)
    sharder = EmbarkEmbeddingBagCollectionSharder(
        fused_params={"optimizer": OPTIMIZERS[optimizer], "learning_rate": lr, "eps": ADAGRAD_EPS},
        invalid_ids=invalid_ids,
        unique_lookup=unique_lookup,
        qcomm_codecs_registry=qcomm_codecs_registry,
    )
    return DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(pg),
        plan=ShardingPlan({"ebc": module_sharding_plan(plan, spec, "cpu")}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def first_bags(kjt: KeyedJaggedTensor, n: int) -> KeyedJaggedTensor:
    """`kjt` cut to the first `n` samples of every feature (0: a batch with no samples)."""
    keys = kjt.keys()
    lengths = kjt.lengths().view(len(keys), -1)
    keep = (torch.arange(lengths.size(1)) < n).expand_as(lengths)
    keep_id = keep.flatten().repeat_interleave(lengths.flatten())
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=keys,
        values=kjt.values()[keep_id],
        lengths=lengths[:, :n].flatten(),
        weights=weights[keep_id] if weights is not None else None,
        stride=n,
    )


def compare_sharded_training(
    tables: list[EmbeddingBagConfig],
    layouts: Mapping[str, TableLayout],
    local_world_size: int,
    steps: int = 2,
    optimizer: str = "sgd",
    weighted: bool = False,
    batch_per_rank: int | Sequence[int] = 4,
    seed: int = 0,
    lr: float = 0.1,
    silent_rank: int | None = None,
    ids: str = "uniform",
    unique_lookup: str = "auto",
    variable_batch: bool = False,
) -> dict[str, float]:
    """Max |sharded - unsharded| per output feature (each step) and per table weight (after all steps).

    `silent_rank` sends no IDs at all (every bag empty), as a rank with nothing for a table would; `ids` as in
    global_kjt_batch; `unique_lookup` as the sharder's; `variable_batch`: VBE input (global_kjt_batch);
    `batch_per_rank` may differ per rank (a list; 0: a rank with no samples).
    """
    sizes = [batch_per_rank] * dist.get_world_size() if isinstance(batch_per_rank, int) else list(batch_per_rank)
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = SparseArch(tables, weighted, torch.device("cpu"))
    model = sharded_model(tables, layouts, local_world_size, weighted, optimizer, lr, unique_lookup=unique_lookup)
    copy_global_weights(model, reference)
    ref_opt = _reference_optimizer(list(reference.named_parameters()), optimizer, lr, layouts)
    dense = [(n, p) for n, p in in_backward_optimizer_filter(model.named_parameters()) if p.numel() > 0]
    dense_opt = _reference_optimizer(dense, optimizer, lr, {}) if dense else None
    diffs: dict[str, float] = {}
    for step in range(steps):
        batch = global_kjt_batch(
            tables,
            ws,
            max(1, *sizes),
            seed=seed + 100 * step,
            weighted=weighted,
            ids=ids,
            variable_batch=variable_batch,
        )
        if len(set(sizes)) > 1 or sizes[0] < max(1, *sizes):
            batch = [first_bags(kjt, n) for kjt, n in zip(batch, sizes)]
        if silent_rank is not None:
            batch[silent_rank] = KeyedJaggedTensor.from_lengths_sync(
                keys=batch[silent_rank].keys(),
                values=batch[silent_rank].values()[:0],
                lengths=torch.zeros_like(batch[silent_rank].lengths()),
                weights=batch[silent_rank].weights()[:0] if weighted else None,
            )
        gen = torch.Generator().manual_seed(seed + step)
        projections = [
            {
                name: torch.randn(n, t.embedding_dim, generator=gen)
                for t, names in zip(tables, get_embedding_names_by_table(tables))
                for name in names
            }
            for n in sizes
        ]
        ref_opt.zero_grad()
        ref_loss = torch.zeros(())
        ref_out_here: dict[str, torch.Tensor] = {}
        for r in range(ws):
            # TorchRec's unsharded EBC cannot split a batch of no samples; its output is empty
            out = reference(batch[r]).to_dict() if sizes[r] else {k: v[:0] for k, v in projections[r].items()}
            ref_loss = ref_loss + _loss(out, projections[r])
            if r == rank:
                ref_out_here = {k: v.detach() for k, v in out.items()}
        if ref_loss.requires_grad:  # (not when no rank has a sample)
            (ref_loss / ws).backward()
        ref_opt.step()
        if dense_opt is not None:
            dense_opt.zero_grad()
        out = model(batch[rank])
        out = (out.wait() if hasattr(out, "wait") else out).to_dict()
        _loss(out, projections[rank]).backward()
        if dense_opt is not None:
            dense_opt.step()
        for k, v in out.items():
            diffs[f"step{step}/{k}"] = max(diffs.get(f"step{step}/{k}", 0.0), _max_abs(v.detach() - ref_out_here[k]))
    diffs.update(weight_diffs(model, reference.state_dict()))
    return diffs


def weight_diffs(model: nn.Module, reference: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Max |weight - reference| per state_dict key ("weight/<key>"), over this rank's local shards of
    sharded tables (the region of the global reference each covers) and whole plain tensors."""
    diffs: dict[str, float] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            worst = 0.0
            for shard in value.local_shards():
                region = reference[key]
                for dim, (off, size) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)):
                    region = region.narrow(dim, off, size)
                worst = max(worst, _max_abs(shard.tensor - region))
            diffs[f"weight/{key}"] = worst
        else:
            diffs[f"weight/{key}"] = _max_abs(value - reference[key])
    return diffs
