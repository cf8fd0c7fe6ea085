"""A user-history model with TorchRec: sequence embeddings (EmbeddingCollection) and pooled ones planned together by
EmbarkPlanner, or everything by TorchRec's default planner and sharders.

    torchrun --standalone --nproc_per_node 4 examples/sequence/train.py [--planner embark|torchrec]
        [--history-layout planned|ub|rw] [--steps S] [--batch-size B] [--local-world-size L]

The model: a user history (Zipf(1.1) IDs over a large table, 1-100 IDs per sample) looked up by an
EmbeddingCollection, one vector per ID, and averaged per sample; a few one-hot and multi-hot features pooled by an
EmbeddingBagCollection; both concatenated into an MLP trained on a click label (BCE). "embark" plans every table in
one search with EmbarkPlanner, on pooling factors and unique ratios profiled from the first batches: a Zipf history
repeats its hot IDs, which a unique-based (UB) layout sends (and looks up) once per batch; "torchrec" runs TorchRec's
EmbeddingShardingPlanner with TorchRec's sharders. --history-layout ub or rw forces the history table into even row
blocks, one per rank, unique-based or row-based (the latter on our grid sharding, so that the same counters count
it), for comparing bytes. Rank 0 prints the plan, progress, and ends with exactly one line `RESULT {json}`
(docs/examples.md, "Sequence", lists its keys).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mlp import MLP
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import JaggedTensor

from embark_torchrec.jobs import WARMUP_HELP, Progress, World, exit_after_clean_run, init_distributed
from embark_torchrec import (
    EmbarkEmbeddingBagCollectionSharder,
    EmbarkEmbeddingCollectionSharder,
    EmbarkPlanner,
    enable_comm_stats,
)
from embark_torchrec.plan import (
    ModelSpec,
    ShardingGroup,
    TableConstraints,
    TableLayout,
    Topology,
    ceil_row_bounds,
    hardware_preset,
    profile_features,
)
from embark_torchrec.planner import torchrec_topology

from sequence_data import HISTORY, PooledFeature, SequenceBatch, SequenceData  # the example's data, next to this file


@dataclass(frozen=True)
class Config:
    """Every default of the example in one place (flags override the run-time ones)."""

    history_rows: int = 1_000_000
    min_length: int = 1
    max_length: int = 100  # uniform lengths: mean 50.5
    features: tuple[PooledFeature, ...] = (
        PooledFeature("user", 100_000, 1, True),
        PooledFeature("context", 1_000, 1, True),
        PooledFeature("tags", 20_000, 5, False),
    )
    embedding_dim: int = 32
    zipf_alpha: float = 1.1
    mlp: tuple[int, ...] = (128, 64)
    steps: int = 200
    batch_size: int = 256  # per rank
    embedding_lr: float = 0.05  # fused row-wise Adagrad
    dense_lr: float = 0.01  # Adagrad
    adagrad_eps: float = 1e-8
    seed: int = 0
    log_every: int = 50
    warmup_steps: int = 10  # left out of samples/s
    pg_timeout_s: float = 120.0


DEFAULTS = Config()
PLANNERS = ("embark", "torchrec")
HISTORY_LAYOUTS = ("planned", "ub", "rw")
PROFILED_BATCHES = 4  # the first batches, whose pooling factors and unique ratios the plan is made for
HARDWARE = {"cpu": "cpu-gloo", "cuda": "dgx-h100"}
EC_PATH = "model.history"  # where SequenceTrain keeps the EmbeddingCollection


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--planner", choices=PLANNERS, default="embark")
    p.add_argument(
        "--history-layout",
        choices=HISTORY_LAYOUTS,
        default="planned",
        help="embark: the history table as planned, or forced unique-based (ub) or row-wise (rw) in row blocks",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="train this many steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per rank per step")
    p.add_argument("--history-rows", type=int, default=d.history_rows, help="rows of the history table")
    p.add_argument("--embedding-lr", type=float, default=d.embedding_lr)
    p.add_argument("--dense-lr", type=float, default=d.dense_lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--local-world-size", type=int, help="ranks per simulated node (default: torchrun's LOCAL_WORLD_SIZE)"
    )
    p.add_argument("--no-pipeline", action="store_true", help="plain loop instead of TrainPipelineSparseDist")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between samples/s and loss lines")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help=WARMUP_HELP)
    p.add_argument(
        "--pg-timeout-s", type=float, default=d.pg_timeout_s, help="process-group timeout (a dead rank fails the rest)"
    )
    args = p.parse_args(argv)
    if args.history_layout != "planned" and args.planner != "embark":
        p.error("--history-layout chooses embark's layout of the history table; use it with --planner embark")
    return args


# ---------------------------------------------------------------- processes


# ---------------------------------------------------------------- model


def mean_per_sample(history: JaggedTensor) -> torch.Tensor:
    """Each sample's mean history vector ([samples, dim]; zeros for an empty history)."""
    lengths = history.lengths()
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths.long())
    summed = (
        history.values().new_zeros(lengths.numel(), history.values().size(1)).index_add_(0, owner, history.values())
    )
    return summed / lengths.clamp(min=1).unsqueeze(1)


# TrainPipelineSparseDist traces forward with torch.fx to find the sharded modules' inputs; the pooling is opaque
torch.fx.wrap("mean_per_sample")


class SequenceModel(nn.Module):
    """Mean of the history's vectors, concatenated with the pooled features, through an MLP to one logit."""

    def __init__(self, history_rows: int, device: torch.device) -> None:
        super().__init__()
        d = DEFAULTS
        dim = d.embedding_dim
        self.history = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=HISTORY, embedding_dim=dim, num_embeddings=history_rows, feature_names=[HISTORY])
            ],
            device=torch.device("meta"),
        )
        self.features = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f.name, embedding_dim=dim, num_embeddings=f.rows, feature_names=[f.name])
                for f in d.features
            ],
            device=torch.device("meta"),
        )
        width = dim * (1 + len(d.features))
        self.mlp = MLP(width, list(d.mlp), device=device)
        self.head = nn.Linear(d.mlp[-1], 1, device=device)

    def forward(self, batch: SequenceBatch) -> torch.Tensor:
        mean = mean_per_sample(self.history(batch.history)[HISTORY])
        pooled = self.features(batch.features).values()
        return self.head(self.mlp(torch.cat([mean, pooled], dim=1))).squeeze(1)


class SequenceTrain(nn.Module):
    """The model and its loss, returning (loss, (loss, logits, labels)) as TrainPipelineSparseDist expects."""

    def __init__(self, model: SequenceModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: SequenceBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


# ---------------------------------------------------------------- plans


def history_layout(kind: str, rows: int, dim: int, world_size: int) -> TableLayout:
    """The history table in even row blocks, one per rank: unique-based (ub) or row-based (rw)."""
    bounds = ceil_row_bounds(rows, world_size)
    return TableLayout("ub" if kind == "ub" else "rb", bounds, (0, dim), tuple((k,) for k in range(world_size)))


def profiled_spec(model: SequenceTrain, data: SequenceData, world: World) -> ModelSpec:
    """Every table's pooling and unique ratio as this rank's first batches show them (the history's length and
    repeats, the pooled features' IDs per sample), for the planner."""
    tables = (*ModelSpec.from_module(model.model.history).tables, *ModelSpec.from_module(model.model.features).tables)
    spec = ModelSpec(name="sequence", batch_size=data.batch_size * world.world_size, tables=tables)
    batches = [data.batch(step, world.rank) for step in range(PROFILED_BATCHES)]
    return profile_features([kjt for b in batches for kjt in (b.history, b.features)], spec, world.world_size).spec


def make_plan(
    args: argparse.Namespace, model: SequenceTrain, data: SequenceData, world: World, sharders: list[Any]
) -> ShardingPlan:
    """The ShardingPlan every rank runs."""
    device_type = world.device.type
    topology = Topology(world.world_size, world.local_world_size, hardware_preset(HARDWARE[device_type]))
    if args.planner == "torchrec":
        planner = EmbeddingShardingPlanner(
            topology=torchrec_topology(topology, device_type), batch_size=args.batch_size
        )
        return planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    forced = None
    if args.history_layout != "planned":
        forced = history_layout(args.history_layout, args.history_rows, DEFAULTS.embedding_dim, world.world_size)
    planner = EmbarkPlanner(
        topology=topology,
        batch_size=args.batch_size,
        compute_device=device_type,
        constraints={HISTORY: TableConstraints(layout=forced)} if forced is not None else None,
        measured=profiled_spec(model, data, world),
    )
    plan = planner.collective_plan(model, sharders)
    if args.history_layout == "rw":
        # row-wise on our grid sharding rather than TorchRec's built-in row_wise, so that the same counters count it
        plan.plan[EC_PATH][HISTORY].sharding_type = ShardingGroup.ours(forced, "sequence").name
    return plan


def describe(plan: ShardingPlan) -> str:
    """One line per table: its module, sharding type and ranks."""
    lines = ["| module | table | sharding type | ranks |", "|---|---|---|---|"]
    for path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():
            lines.append(f"| {path} | {table} | {ps.sharding_type} | {ps.ranks} |")
    return "\n".join(lines)


def sharders_for(planner: str, args: argparse.Namespace) -> list[Any]:
    """Ours (which also run TorchRec's types) for embark, TorchRec's for torchrec; the same fused optimizer."""
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": args.embedding_lr,
        "eps": DEFAULTS.adagrad_eps,
    }
    if planner == "embark":
        return [
            EmbarkEmbeddingBagCollectionSharder(fused_params=fused),
            EmbarkEmbeddingCollectionSharder(fused_params=fused),
        ]
    return [EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused)]


# ---------------------------------------------------------------- training


def _gather(values: list[int], device: torch.device) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


class Trainer:
    """One run: __init__ builds the job, data, plan, sharded model and optimizers from the flags; train() trains;
    finish() prints the RESULT line."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.world = world = init_distributed(args.local_world_size, args.pg_timeout_s, "examples/sequence/train.py")
        torch.manual_seed(args.seed)  # the same dense initial weights on every rank and for every planner
        d = DEFAULTS
        self.data = SequenceData(
            args.history_rows, d.features, args.batch_size, d.zipf_alpha, d.min_length, d.max_length, args.seed
        )
        model = SequenceTrain(SequenceModel(args.history_rows, world.device))
        sharders = sharders_for(args.planner, args)
        start = time.perf_counter()
        self.plan = make_plan(args, model, self.data, world, sharders)
        plan_s = time.perf_counter() - start
        if world.rank == 0:
            print(f"# {args.planner} plan ({plan_s:.2f} s)\n{describe(self.plan)}", flush=True)
        self.model = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            plan=self.plan,
            sharders=sharders,
            device=world.device,
        )
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(self.model.named_parameters())),
            lambda params: torch.optim.Adagrad(params, lr=args.dense_lr, eps=d.adagrad_eps),
        )
        self.optimizer = CombinedOptimizer([self.model.fused_optimizer, dense])
        # our sharders count their collectives; TorchRec's do not, so its runs report no bytes
        self.stats = enable_comm_stats(self.model) if args.planner == "embark" else None
        self.progress = Progress()

    def train(self) -> None:
        """Steps 0..steps-1, each batch once (the pipeline reads up to two batches ahead)."""
        args, world, progress = self.args, self.world, self.progress
        batches: Iterator[SequenceBatch] = (self.data.batch(step, world.rank) for step in range(args.steps))
        pipeline = (
            None
            if args.no_pipeline
            else TrainPipelineSparseDist(self.model, self.optimizer, world.device, execute_all_batches=True)
        )
        samples_per_step = args.batch_size * world.world_size
        window_loss, window_steps = torch.zeros((), device=world.device), 0
        dist.barrier()
        progress.start(args.steps, args.warmup_steps, pipelined=pipeline is not None)
        window_start = time.perf_counter()
        for step in range(args.steps):
            if pipeline is not None:
                loss, _, _ = pipeline.progress(batches)
            else:
                loss, _ = self.model(next(batches).to(world.device))
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad()
            progress.step_done(step + 1)
            window_loss += loss.detach()
            window_steps += 1
            if window_steps == args.log_every or step + 1 == args.steps:
                mean_loss, rate = progress.log_window(
                    window_loss, window_steps, samples_per_step, window_start, world.device
                )
                if world.rank == 0:
                    print(f"step {step + 1}: loss {mean_loss:.4f}, {rate:,.0f} samples/s", flush=True)
                window_loss, window_steps, window_start = torch.zeros((), device=world.device), 0, time.perf_counter()

    def _comm(self) -> dict[str, Any]:
        """Counted bytes: every rank's sent + received (all tables, and inter-node), their maximum, and the history
        table's bytes sent by all ranks together (each byte on the wire once); None where nothing counts."""
        if self.stats is None:
            return {k: None for k in ("comm_bytes", "inter_node_bytes", "comm_bytes_by_rank", "history_bytes")}
        t = self.stats.totals()
        history = self.stats.by("table").get(HISTORY, {"sent": 0})
        every = _gather(
            [t["sent"] + t["received"], t["sent_inter"] + t["received_inter"], history["sent"]], self.world.device
        )
        return {
            "comm_bytes": max(e[0] for e in every),
            "inter_node_bytes": max(e[1] for e in every),
            "comm_bytes_by_rank": [e[0] for e in every],
            "history_bytes": sum(e[2] for e in every),
        }

    def finish(self) -> None:
        args, world, progress = self.args, self.world, self.progress
        comm = self._comm()
        if world.rank == 0:
            samples = progress.measured_steps * args.batch_size * world.world_size
            steps = max(args.steps, 1)
            per_step = {
                k: (v // steps if isinstance(v, int) else None) for k, v in comm.items() if k != "comm_bytes_by_rank"
            }
            result = {
                "planner": args.planner,
                "history_layout": args.history_layout if args.planner == "embark" else None,
                "history_sharding": self.plan.plan[EC_PATH][HISTORY].sharding_type,
                "world_size": world.world_size,
                "local_world_size": world.local_world_size,
                "device": world.device.type,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "samples_per_s": round(samples / progress.measured_seconds, 1) if samples else None,
                "first_loss": progress.first_loss,
                "final_loss": progress.last_loss,
                **comm,
                **{f"{k}_per_step": v for k, v in per_step.items()},
            }
            print("RESULT " + json.dumps(result), flush=True)
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    trainer = Trainer(parse_args(argv))
    trainer.train()
    trainer.finish()


if __name__ == "__main__":
    main()
    exit_after_clean_run()
