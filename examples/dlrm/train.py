"""DLRM-DCNv2 training with TorchRec, sharded by EMBark's planner (or TorchRec's default / TWRW plans).

    torchrun --standalone --nproc_per_node 2 examples/dlrm/train.py [--planner embark|torchrec|trw]
        [--model SPEC] [--data DIR] [--steps S] [--batch-size B] [--local-world-size L]
        [--plan-in FILE] [--plan-out FILE] [--checkpoint-dir D [--save-every K] [--resume]]
        [--hardware PRESET | FILE.json] [--calibrate [quick]]

Everything but the plan is TorchRec: torchrec.models.dlrm.DLRM_DCN, DistributedModelParallel with
EmbarkEmbeddingBagCollectionSharder (fused row-wise Adagrad), TrainPipelineSparseDist, and
torch.distributed.checkpoint. Rank 0 prints the plan report, progress, and ends with exactly one
line `RESULT {json}` (docs/examples.md lists its keys).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from tqdm import tqdm

from embark_torchrec.jobs import (
    WARMUP_HELP,
    Progress,
    World,
    exit_after_clean_run,
    init_distributed,
    max_over_ranks,
)
from embark_torchrec import (
    EmbarkEmbeddingBagCollectionSharder,
    EmbarkPlanner,
    data_parallel_wrapper,
    enable_comm_stats,
    load_plan,
)
from embark_torchrec import calibrate as calibration
from embark_torchrec.sharding.stage_times import StageTimes, timing_stages
from embark_torchrec import checkpoint
from embark_torchrec.plan import (
    ALLREDUCE_PRECISIONS,
    ELEMENT_BYTES,
    PRECISIONS,
    CostModel,
    Hardware,
    IdDistribution,
    ModelSpec,
    Plan,
    ScoredPlan,
    SearchConfig,
    TableSpec,
    Topology,
    UsageError,
    WirePrecision,
    builtin_model,
    check_document,
    check_output,
    hardware_sources,
    load_model_spec,
    names_a_file,
    profile_features,
    render,
    resolve_hardware,
    save_hardware,
    table_row_wise_plan,
)
from embark_torchrec.planner import from_sharding_plan, module_sharding_plan, torchrec_constraints, torchrec_topology

from dlrm_data import CriteoData, DataSource, SyntheticData  # the example's own data module, next to this file


@dataclass(frozen=True)
class Config:
    """Every default of the example in one place (flags override the run-time ones)."""

    # the default model: DCNv2-shaped (rows spread over two decades, mixed multi-hot sizes), CPU-sized
    table_rows: tuple[int, ...] = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 100_000)
    table_pooling: tuple[int, ...] = (1, 2, 4, 8, 3, 6, 12, 20)
    embedding_dim: int = 32
    zipf_alpha: float = 1.1
    # the dense part: bottom MLP (its last layer is the embedding dim), DCN v2 low-rank cross layers, top MLP
    bottom_mlp: tuple[int, ...] = (64,)
    dcn_layers: int = 3
    dcn_low_rank: int = 64
    top_mlp: tuple[int, ...] = (128, 64, 1)
    # training
    steps: int = 300
    batch_size: int = 512  # per rank
    embedding_lr: float = 0.05  # fused row-wise Adagrad
    dense_lr: float = 0.005  # Adagrad (DCN diverges at 0.05)
    adagrad_eps: float = 1e-8
    seed: int = 0
    log_every: int = 50
    warmup_steps: int = 10  # left out of samples/s
    eval_batches: int = 20  # held-out batches per rank for AUROC
    profile_batches: int = 8  # rank 0's first training batches, measured for pooling and unique ratios
    pg_timeout_s: float = 120.0


DEFAULTS = Config()
CPU_HARDWARE, GPU_HARDWARE = "cpu-gloo", "dgx-h100"
PLANNERS = ("embark", "torchrec", "trw")
EBC_PATH = "model.sparse_arch.embedding_bag_collection"  # where DLRMTrain keeps the EmbeddingBagCollection


def _at_least(minimum: int) -> Callable[[str], int]:
    """A flag that counts something: an integer >= minimum (--steps -5 ran 0 steps and reported -5, --batch-size 0
    and --eval-batches 0 failed deep inside the data and the metric)."""

    def parse(value: str) -> int:
        try:
            count = int(value)
        except ValueError:
            count = minimum - 1
        if count < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value!r}")
        return count

    return parse


def _finite(positive: bool) -> Callable[[str], float]:
    """A flag that measures something: a finite number, > 0 (a timeout) or >= 0 (a learning rate; nan trained on
    NaN without a word)."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0 or (positive and number == 0):
            raise argparse.ArgumentTypeError(f"expected a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
        return number

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--planner", choices=PLANNERS, default="embark")
    p.add_argument(
        "--model",
        help="model spec file (JSON/YAML) or built-in name (dcnv2, t180, t200, t510); "
        "default: a CPU-sized DCNv2-shaped model",
    )
    p.add_argument(
        "--data",
        type=Path,
        help="directory of TorchRec's binary Criteo files day_<i>_{dense,sparse,labels}.npy; default: synthetic data",
    )
    p.add_argument("--steps", type=_at_least(0), default=d.steps, help="train until this global step")
    p.add_argument("--batch-size", type=_at_least(1), default=d.batch_size, help="samples per rank per step")
    p.add_argument("--embedding-lr", type=_finite(positive=False), default=d.embedding_lr)
    p.add_argument("--dense-lr", type=_finite(positive=False), default=d.dense_lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--local-world-size", type=_at_least(1), help="ranks per simulated node (default: torchrun's LOCAL_WORLD_SIZE)"
    )
    p.add_argument(
        "--hardware",
        help=f"planner hardware: a preset or a hardware file (JSON) (default: {GPU_HARDWARE} on CUDA, {CPU_HARDWARE} "
        "on CPU); with --calibrate, the preset the figures not measured come from",
    )
    p.add_argument(
        "--calibrate",
        nargs="?",
        const="full",
        choices=("full", "quick", "dense"),
        help="first measure this job's hardware on its own ranks (python -m embark_torchrec.calibrate; 'quick': "
        "seconds, wide spreads; 'dense': only this model's dense part, the rest from --hardware, a hardware file "
        "calibrated on these ranks), write the hardware file next to --plan-out (else in a temporary directory) "
        "and plan with it",
    )
    p.add_argument(
        "--wire-precision",
        choices=PRECISIONS,
        default="fp32",
        help="embark planner: precision of embeddings and gradients on the wire, for every model-parallel cluster, "
        "and of DDP's all-reduce (dense part and data-parallel tables) where DDP runs it (fp16, bf16)",
    )
    p.add_argument("--plan-in", type=Path, help="run this plan file instead of planning")
    p.add_argument("--plan-out", type=Path, help="write the plan that runs (any planner) as a plan file")
    p.add_argument("--no-pipeline", action="store_true", help="plain loop instead of TrainPipelineSparseDist")
    p.add_argument(
        "--stage-times",
        type=Path,
        help="write each rank's time per training step and stage (forward, backward, their exchange waits) as "
        "DIR/rank<r>.json (benchmarks/step_stages.py)",
    )
    p.add_argument("--log-every", type=_at_least(0), default=d.log_every, help="steps between samples/s and loss lines")
    p.add_argument("--warmup-steps", type=_at_least(0), default=d.warmup_steps, help=WARMUP_HELP)
    p.add_argument(
        "--eval-batches", type=_at_least(1), default=d.eval_batches, help="held-out batches per rank for AUROC"
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="torch.distributed.checkpoint directory (a step_<n> folder per save); one run at a time: a run whose "
        "directory another live run holds stops before planning, naming that run",
    )
    p.add_argument("--save-every", type=_at_least(0), default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in --checkpoint-dir; one at or past --steps trains "
        "nothing: the run says so and ends (exit 0, steps_run 0, nothing saved)",
    )
    p.add_argument(
        "--pg-timeout-s",
        type=_finite(positive=True),
        default=d.pg_timeout_s,
        help="process-group timeout (a dead rank fails the rest)",
    )
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.calibrate and args.plan_in:
        p.error("--calibrate measures the hardware to plan with; --plan-in runs a plan file without planning")
    if args.calibrate == "dense" and not (args.hardware and names_a_file(args.hardware)):
        p.error("--calibrate dense measures this model's dense part into --hardware's file: give --hardware FILE.json")
    return args


# ---------------------------------------------------------------- processes and devices


# ---------------------------------------------------------------- model spec, data and model


def default_spec(num_tables: int = len(DEFAULTS.table_rows)) -> ModelSpec:
    """The CPU-sized DCNv2-shaped model; another table count spreads rows log-uniformly over the same range
    and cycles the pooling factors (e.g. 26 tables for Criteo's 26 categorical columns)."""
    d = DEFAULTS
    rows = (
        d.table_rows
        if num_tables == len(d.table_rows)
        else tuple(int(r) for r in np.geomspace(min(d.table_rows), max(d.table_rows), num_tables).round(-2))
    )
    pools = [d.table_pooling[i % len(d.table_pooling)] for i in range(num_tables)]
    tables = tuple(TableSpec(f"t{i}", r, d.embedding_dim, float(p)) for i, (r, p) in enumerate(zip(rows, pools)))
    return ModelSpec("dlrm-dcnv2-cpu", 1, tables, IdDistribution("zipf", d.zipf_alpha))


def load_spec(model: str | None, one_hot_features: int | None) -> ModelSpec:
    """--model (a file or a built-in name) or the default; Criteo data is one-hot, so pooling becomes 1."""
    if model is None:
        spec = default_spec(one_hot_features) if one_hot_features else default_spec()
    else:
        spec = load_model_spec(model) if Path(model).exists() else builtin_model(model)
    dims = sorted({t.dim for t in spec.tables})
    if len(dims) != 1:
        raise SystemExit(
            f"model {spec.name!r}: DLRM-DCNv2 needs one embedding dim for every table, the spec has {dims}"
        )
    readers: dict[str, list[str]] = {}
    for t in spec.tables:
        for f in t.feature_names:
            readers.setdefault(f, []).append(t.name)
    shared = {f: tables for f, tables in readers.items() if len(tables) > 1}
    if shared:
        f, tables = next(iter(shared.items()))
        raise SystemExit(
            f"model {spec.name!r}: feature {f!r} feeds tables {tables}; TorchRec's DLRM (this example's model) looks "
            "each feature's pooled embedding up by the feature's name, which a feature read by several tables does "
            "not have (TorchRec names it per table), so the example trains no shared features"
        )
    if one_hot_features is not None:
        features = sum(len(t.feature_names) for t in spec.tables)
        if features != one_hot_features:
            raise SystemExit(
                f"model {spec.name!r} has {features} features, "
                f"the Criteo files have {one_hot_features} categorical columns"
            )
        spec = replace(spec, tables=tuple(replace(t, pooling=1.0) for t in spec.tables))
    return spec


def build_model(spec: ModelSpec, dense_features: int, device: torch.device) -> DLRMTrain:
    """DLRM_DCN with its embedding tables on the meta device (DMP materialises only each rank's shards)."""
    d = DEFAULTS
    dim = spec.tables[0].dim
    tables = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.feature_names))
        for t in spec.tables
    ]
    dlrm = DLRM_DCN(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=dense_features,
        dense_arch_layer_sizes=[*d.bottom_mlp, dim],
        over_arch_layer_sizes=list(d.top_mlp),
        dcn_num_layers=d.dcn_layers,
        dcn_low_rank_dim=d.dcn_low_rank,
        dense_device=device,
    )
    return DLRMTrain(dlrm)


# ---------------------------------------------------------------- plans


def dense_step(model: DLRMTrain, batch_size: int, dense_features: int, device: torch.device) -> calibration.DenseStep:
    """One rank's training step of the model's dense part (a copy: bottom MLP, DCN interaction, top MLP, the dense
    optimizer) on random inputs and embeddings, for --calibrate to time: every plan runs it alike."""
    dlrm = model.model
    dense = torch.nn.ModuleDict(
        {"dense_arch": dlrm.dense_arch, "inter_arch": dlrm.inter_arch, "over_arch": dlrm.over_arch}
    )
    dense = copy.deepcopy(dense).to(device)
    optimizer = torch.optim.Adagrad(dense.parameters(), lr=DEFAULTS.dense_lr, eps=DEFAULTS.adagrad_eps)
    tables = dlrm.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    inputs = torch.randn(batch_size, dense_features, device=device)
    embeddings = torch.randn(batch_size, len(tables), tables[0].embedding_dim, device=device)
    labels = torch.randint(0, 2, (batch_size,), device=device).float()

    def step() -> None:
        d = dense["dense_arch"](inputs)
        logits = dense["over_arch"](dense["inter_arch"](dense_features=d, sparse_features=embeddings)).squeeze(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    return calibration.DenseStep(step=step, samples=batch_size, params=sum(p.numel() for p in dense.parameters()))


def job_hardware(
    args: argparse.Namespace, world: World, dense: calibration.DenseStep | None
) -> tuple[Hardware, dict[str, str] | None]:
    """--hardware (a preset or a hardware file) or, with --calibrate, what every rank of this job measures,
    this model's dense part included (rank 0 writes the hardware file next to --plan-out, else in a temporary
    directory); and which of its figures were measured (a hardware file's sources; None for a preset)."""
    chosen = args.hardware or (GPU_HARDWARE if world.device.type == "cuda" else CPU_HARDWARE)
    try:
        base = resolve_hardware(chosen)
        sources = hardware_sources(chosen)
    except ValueError as e:  # HardwareError names the file and the field
        raise SystemExit(f"--hardware: {e}") from None
    if not args.calibrate:
        return base, sources
    settings = calibration.GPU_SETTINGS if world.device.type == "cuda" else calibration.CPU_SETTINGS
    settings = calibration.quick(settings) if args.calibrate == "quick" else settings
    if args.calibrate == "dense":
        assert dense is not None
        try:
            document = calibration.recalibrate_dense(json.loads(Path(chosen).read_text()), settings, dense, chosen)
        except ValueError as e:
            raise SystemExit(f"--calibrate dense: {e}") from None
    else:
        document = calibration.calibrate(settings, chosen, dense=dense)
    if world.rank == 0:
        out = (
            args.plan_out.with_name(args.plan_out.stem + ".hardware.json")
            if args.plan_out
            else Path(tempfile.mkdtemp(prefix="embark-hardware-")) / "hardware.json"
        )
        save_hardware(out, document)
        print(calibration.summary(document), flush=True)
        print(f"hardware file written to {out}", flush=True)
    return check_document(document), dict(document["sources"])


def allreduce_precision(args: argparse.Namespace) -> str:
    """DDP's all-reduce precision (dense part and data-parallel tables), the same on every rank: a plan file's;
    the embark planner's --wire-precision where DDP can run it (fp16, bf16); else fp32."""
    if args.plan_in:
        return Plan.load(args.plan_in).allreduce_precision
    wire = args.wire_precision
    return wire if args.planner == "embark" and wire in ALLREDUCE_PRECISIONS else "fp32"


def make_plan(
    args: argparse.Namespace, model: DLRMTrain, spec: ModelSpec, topology: Topology, world: World, sharder: Any
) -> tuple[ShardingPlan, Plan | None, float]:
    """The ShardingPlan every rank runs; rank 0 also gets it as a Plan (for the report and --plan-out)
    and the planning seconds."""
    device_type = world.device.type
    start = time.perf_counter()
    if args.plan_in:
        plan = Plan.load(args.plan_in)
        return load_plan(plan, model, compute_device=device_type), plan, time.perf_counter() - start
    if args.planner == "embark":
        planner = EmbarkPlanner(
            world_size=world.world_size,
            local_world_size=world.local_world_size,
            batch_size=args.batch_size,
            hardware=topology.hardware,
            constraints=torchrec_constraints(spec),
            compute_device=device_type,
            measured=spec,
            config=SearchConfig(
                precision={
                    **{c: WirePrecision(args.wire_precision, args.wire_precision) for c in ("rb", "ub")},
                    "dp": WirePrecision("fp32", allreduce_precision(args)),
                }
            ),
        )
        sharding_plan = planner.collective_plan(model, [sharder])
        ours = planner.plans[EBC_PATH].plan if world.rank == 0 else None
        return sharding_plan, ours, time.perf_counter() - start
    if args.planner == "torchrec":
        planner = EmbeddingShardingPlanner(
            topology=torchrec_topology(topology, device_type),
            batch_size=args.batch_size,
            constraints=torchrec_constraints(spec),
        )
        sharding_plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
        ours = from_sharding_plan(sharding_plan, topology, EBC_PATH) if world.rank == 0 else None
        return sharding_plan, ours, time.perf_counter() - start
    trw = table_row_wise_plan(spec, topology)  # deterministic: every rank computes the same
    return ShardingPlan({EBC_PATH: module_sharding_plan(trw, spec, device_type)}), trw, time.perf_counter() - start


# ---------------------------------------------------------------- checkpoints


def _state(model: torch.nn.Module, optimizer: CombinedOptimizer, step: int) -> dict[str, Any]:
    """What a checkpoint holds: weights (sharded tables as ShardedTensors), the fused and dense optimizer
    state, and the step; dcp.load writes into these tensors in place."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": torch.tensor(step)}


def save_checkpoint(directory: Path, model: torch.nn.Module, optimizer: CombinedOptimizer, step: int) -> None:
    """directory/step_<n> with a manifest of its files' hashes, visible only once complete (see
    embark_torchrec.checkpoint)."""
    checkpoint.save_checkpoint(directory, _state(model, optimizer, step), step)


# ---------------------------------------------------------------- training and evaluation


def train(
    args: argparse.Namespace,
    model: torch.nn.Module,
    optimizer: CombinedOptimizer,
    data: DataSource,
    world: World,
    start_step: int,
) -> tuple[torch.nn.Module, Progress]:
    """Steps start_step..args.steps-1; the data iterator yields exactly those batches, so the pipeline
    (which reads up to two batches ahead) trains on each once and never past the end."""
    progress = Progress()
    batches: Iterator[Batch] = progress.timed(data.batch(step, world.rank) for step in range(start_step, args.steps))
    pipeline = (
        None if args.no_pipeline else TrainPipelineSparseDist(model, optimizer, world.device, execute_all_batches=True)
    )
    samples_per_step = args.batch_size * world.world_size
    # the bar on rank 0's terminal only (None: off when stdout is not a TTY, so logs get just the log lines)
    bar = tqdm(
        total=args.steps,
        initial=start_step,
        disable=True if world.rank else None,
        unit="step",
        dynamic_ncols=True,
        file=sys.stdout,
    )
    window_loss, window_steps = torch.zeros((), device=world.device), 0
    dist.barrier()
    progress.start(args.steps - start_step, args.warmup_steps, pipelined=pipeline is not None)
    window_start = time.perf_counter()
    with ExitStack() as stages:
        times = stages.enter_context(timing_stages(StageTimes(), model)) if args.stage_times else None
        for step in range(start_step, args.steps):
            if pipeline is not None:
                loss, _, _ = pipeline.progress(batches)
            else:
                loss, _ = model(next(batches).to(world.device))
                backward_start = time.perf_counter()
                loss.backward()
                if times is not None:
                    times.add("backward", time.perf_counter() - backward_start)
                optimizer.step()
                optimizer.zero_grad()
            progress.step_done(step + 1 - start_step)
            if times is not None:
                times.step_done()
            window_loss += loss.detach()
            window_steps += 1
            bar.update(1)
            if window_steps == args.log_every or step + 1 == args.steps:
                mean_loss, rate = progress.log_window(
                    window_loss, window_steps, samples_per_step, window_start, world.device
                )
                bar.set_postfix(loss=f"{mean_loss:.4f}")
                if world.rank == 0:
                    tqdm.write(f"step {step + 1}: loss {mean_loss:.4f}, {rate:,.0f} samples/s", file=sys.stdout)
                window_loss, window_steps, window_start = torch.zeros((), device=world.device), 0, time.perf_counter()
            if args.checkpoint_dir and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                saving = time.perf_counter()
                save_checkpoint(args.checkpoint_dir, model, optimizer, step + 1)
                progress.pause(time.perf_counter() - saving)  # saves are not training throughput
    bar.close()
    if times is not None:
        times.write(args.stage_times / f"rank{world.rank}.json", world.rank)
    return (pipeline.detach() if pipeline is not None else model), progress


@torch.no_grad()
def heldout_auroc(model: torch.nn.Module, data: DataSource, batches: int, world: World) -> float:
    """AUROC over every rank's held-out batches (torchmetrics gathers the ranks' predictions)."""
    model.eval()
    metric = BinaryAUROC().to(world.device)
    for i in range(batches):
        _, (_, logits, labels) = model(data.batch(i, world.rank, "heldout").to(world.device))
        metric.update(torch.sigmoid(logits), labels.int())
    model.train()
    return float(metric.compute())


def comm_totals(stats: Any, device: torch.device) -> dict[str, Any]:
    """Every rank's counted bytes (all traffic, and inter-node traffic) and their maximum over ranks."""
    t = stats.totals()
    mine = torch.tensor(
        [t["sent"] + t["received"], t["sent_inter"] + t["received_inter"]], dtype=torch.int64, device=device
    )
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    total, inter = [int(x[0]) for x in every], [int(x[1]) for x in every]
    return {
        "comm_bytes": max(total),
        "inter_node_bytes": max(inter),
        "comm_bytes_by_rank": total,
        "inter_node_bytes_by_rank": inter,
    }


# ---------------------------------------------------------------- the trainer


def nothing_resumed(directory: Path, skipped: Sequence[checkpoint.Skipped]) -> str:
    """Why resume loaded nothing, from the folders it skipped (each printed above with its reason): the steps there
    failed their manifest check, or verified but did not load into this model, or there is no finished step."""
    loads = sum(s.reason.startswith(checkpoint.LOAD_FAILED) for s in skipped)
    steps = sum(checkpoint.step_of(s.path) is not None or s.path.name.endswith(".replaced") for s in skipped)
    if steps == 0:
        return f"no finished checkpoint in {directory} (only unfinished saves, or names that are not step_<int>)"
    if loads == 0:
        return f"no checkpoint in {directory} verifies"
    unverified = f"; {steps - loads} did not verify" if steps > loads else ""
    return f"no checkpoint in {directory} loads into this model ({loads} verified but did not load{unverified})"


class Trainer:
    """One run of the example, in torchtitan's shape: __init__ builds everything from the flags (the
    job, the data, the plan, the sharded model and optimizers, a resumed checkpoint), train() trains,
    finish() saves, evaluates and prints the RESULT line."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.world = world = init_distributed(args.local_world_size, args.pg_timeout_s, "examples/dlrm/train.py")
        self._claim_outputs()
        torch.manual_seed(args.seed)  # the same dense initial weights on every rank and for every planner
        spec = load_spec(args.model, CriteoData.columns(args.data) if args.data else None).with_batch_size(
            args.batch_size * world.world_size
        )
        self.data: DataSource = (
            CriteoData(args.data, spec, args.batch_size, world.world_size)
            if args.data
            else SyntheticData(spec, args.batch_size, seed=args.seed)
        )
        # plan on what the data really holds: each table's pooling and unique ratio in rank 0's first batches
        profiled = (self.data.batch(step, 0).sparse_features for step in range(DEFAULTS.profile_batches))
        spec = profile_features(profiled, spec, world_size=world.world_size).spec
        model = build_model(spec, self.data.dense_features, world.device)
        dense = dense_step(model, args.batch_size, self.data.dense_features, world.device) if args.calibrate else None
        hardware, self.hardware_sources = job_hardware(args, world, dense)
        topology = Topology(world.world_size, world.local_world_size, hardware)
        sharder = EmbarkEmbeddingBagCollectionSharder(
            fused_params={
                "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "learning_rate": args.embedding_lr,
                "eps": DEFAULTS.adagrad_eps,
            }
        )
        self.planner_name = "file" if args.plan_in else args.planner
        sharding_plan, plan, plan_s = make_plan(args, model, spec, topology, world, sharder)
        self.estimated_step_ms = self._report(plan, plan_s, spec, topology)
        allreduce = allreduce_precision(args)  # every rank's, where only rank 0 holds the plan
        self.model = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            plan=sharding_plan,
            sharders=[sharder],
            device=world.device,
            data_parallel_wrapper=data_parallel_wrapper(allreduce),
        )
        replicated = dict(in_backward_optimizer_filter(self.model.named_parameters()))
        # what DDP all-reduces every step: the dense part's and data-parallel tables' gradients, not counted by stats
        elements = sum(p.numel() for p in replicated.values())
        self.allreduce_bytes = int(elements * ELEMENT_BYTES[allreduce])
        dense = KeyedOptimizerWrapper(
            replicated, lambda params: torch.optim.Adagrad(params, lr=args.dense_lr, eps=DEFAULTS.adagrad_eps)
        )
        self.optimizer = CombinedOptimizer([self.model.fused_optimizer, dense])
        self.start_step = self._resume()
        self.stats = enable_comm_stats(self.model)
        self.stats.reset()
        self.progress = Progress()

    def _claim_outputs(self) -> None:
        """What this run will write, checked on every rank before planning (a bad path surfaced only after planning,
        on rank 0, and the other ranks reported gloo's "Connection closed by peer" first): rank 0 checks --plan-out
        and tells every rank; --checkpoint-dir becomes this run's (checkpoint.claim_checkpoint_directory)."""
        problem: list[str | None] = [None]
        if self.world.rank == 0:
            try:
                check_output("--plan-out", self.args.plan_out)
            except UsageError as e:
                problem[0] = str(e)
        dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise SystemExit(problem[0])
        if self.args.checkpoint_dir:
            previous = checkpoint.claim_checkpoint_directory(self.args.checkpoint_dir)
            if previous is not None and self.world.rank == 0:
                print(
                    f"checkpoint directory {self.args.checkpoint_dir}: taken over from {previous.describe()}, "
                    "whose process is gone",
                    flush=True,
                )

    def _report(self, plan: Plan | None, plan_s: float, spec: ModelSpec, topology: Topology) -> float | None:
        """Rank 0 prints the plan report (and writes --plan-out); returns the plan's estimated step ms."""
        if self.world.rank != 0:
            return None
        assert plan is not None
        cost = CostModel(spec, topology).evaluate(plan)
        scored = [ScoredPlan(self.planner_name, plan, cost, plan_s)]
        print(render(scored, topology, spec.name, self.hardware_sources), flush=True)
        if self.args.plan_out:
            plan.save(self.args.plan_out)
            print(f"plan file written to {self.args.plan_out}", flush=True)
        return cost.step_ms

    def _resume(self) -> int:
        """The step to start from: with --resume, that of the newest checkpoint whose files match its manifest
        (rank 0 says which newer ones it skipped and why), else 0."""
        if not self.args.resume:
            return 0
        state = _state(self.model, self.optimizer, 0)
        found = checkpoint.resume_checkpoint(self.args.checkpoint_dir, state)
        if self.world.rank == 0:
            for path, reason in found.skipped:
                print(f"skipped checkpoint {path}: {reason}", flush=True)
        if found.path is None:
            if self.world.rank == 0 and found.skipped:
                print(f"{nothing_resumed(self.args.checkpoint_dir, found.skipped)}: starting at step 0", flush=True)
            return 0
        self.optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        if self.world.rank == 0:
            print(f"resumed from {found.path} at step {step}", flush=True)
            if step >= self.args.steps:
                print(
                    f"the checkpoint's step {step} is at or past --steps {self.args.steps}: nothing to train",
                    flush=True,
                )
        return step

    def train(self) -> None:
        """Train from the resumed step to --steps; nothing when the checkpoint is at or past --steps."""
        if self.start_step >= self.args.steps:
            return
        self.model, self.progress = train(self.args, self.model, self.optimizer, self.data, self.world, self.start_step)

    def finish(self) -> None:
        args, world, progress = self.args, self.world, self.progress
        comm = comm_totals(self.stats, world.device)
        steps_run = max(args.steps - self.start_step, 0)
        if args.checkpoint_dir and steps_run > 0:
            save_checkpoint(args.checkpoint_dir, self.model, self.optimizer, args.steps)
        auc = heldout_auroc(self.model, self.data, args.eval_batches, world)
        # making one batch on the slowest rank: part of the measured step, no part of the estimate
        data_ms = max_over_ranks(progress.data_seconds / max(progress.batches_made, 1) * 1e3, world.device)
        if world.rank == 0:
            assert self.estimated_step_ms is not None
            samples = progress.measured_steps * args.batch_size * world.world_size
            per_step = max(steps_run, 1)
            result = {
                "planner": self.planner_name,
                "world_size": world.world_size,
                "local_world_size": world.local_world_size,
                "device": world.device.type,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "steps_run": steps_run,
                "samples_per_s": round(samples / progress.measured_seconds, 1) if samples else None,
                "step_ms": round(progress.measured_seconds / progress.measured_steps * 1e3, 3) if samples else None,
                "data_ms_per_step": round(data_ms, 3),
                "first_loss": progress.first_loss,
                "final_loss": progress.last_loss,
                "auc": round(auc, 5),
                "comm_bytes": comm["comm_bytes"],
                "inter_node_bytes": comm["inter_node_bytes"],
                "comm_bytes_per_step": comm["comm_bytes"] // per_step,
                "inter_node_bytes_per_step": comm["inter_node_bytes"] // per_step,
                "comm_bytes_by_rank": comm["comm_bytes_by_rank"],
                "inter_node_bytes_by_rank": comm["inter_node_bytes_by_rank"],
                "allreduce_bytes_per_step": self.allreduce_bytes,
                "estimated_step_ms": round(self.estimated_step_ms, 4),
            }
            print("RESULT " + json.dumps(result), flush=True)
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    """One run; a checkpoint that cannot be claimed or saved ends it on every rank with one line naming the folder,
    the step and the cause (every rank raises CheckpointError at the same point, so none waits on another)."""
    try:
        trainer = Trainer(parse_args(argv))
        trainer.train()
        trainer.finish()
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"examples/dlrm/train.py: {e}") from None


if __name__ == "__main__":
    main()
    exit_after_clean_run()
