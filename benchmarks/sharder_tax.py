"""What our sharder costs where the plan is TorchRec's own: facebookresearch/dlrm's dlrm_main.py case, in one spawn.

dlrm_main.py's model at its defaults (torchrec's DLRM: 26 one-hot tables of 100,000 rows x 64, dense arch 512-256-64,
over arch 512-512-256-1, batch 32 per rank, fused SGD in backward, random Criteo-shaped data) on 2 gloo ranks, planned
by TorchRec's EmbeddingShardingPlanner (every table table-wise, fused), trained by TrainPipelineSparseDist twice: with
TorchRec's EmbeddingBagCollectionSharder and with ours, the same plan, weights and batches. Per step on rank 0:
aten ops, host syncs and collectives (HostWorkCounter), Python function calls (cProfile's count, the host work the op
counts do not see) and the top functions by own time; then step times in interleaved rounds (TorchRec's, ours, ...,
the order swapped every round), each round the median of its steps, and the median of per-round ratios. Counts do
not depend on the box's load; times do (the load average is printed with them).

    python benchmarks/sharder_tax.py [--rounds 7] [--steps 30] [--batch-size 32] [--top 12] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.host_work import HostWorkCounter

WORLD_SIZE = 2
ROWS, DIM, LR = 100_000, 64, 15.0  # dlrm_main.py's defaults
DENSE_ARCH, OVER_ARCH = [512, 256, 64], [512, 512, 256, 1]
SHARDERS = {"torchrec": EmbeddingBagCollectionSharder, "ours": EmbarkEmbeddingBagCollectionSharder}
COUNTED_STEPS = 5


def _model(sharder_name: str, batch_size: int) -> tuple[TrainPipelineSparseDist, DistributedModelParallel]:
    """dlrm_main.py's model, plan and optimizers, sharded by `sharder_name`'s sharder (the plan is TorchRec's)."""
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
        for f in DEFAULT_CAT_NAMES
    ]
    train = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=len(DEFAULT_INT_NAMES),
            dense_arch_layer_sizes=DENSE_ARCH,
            over_arch_layer_sizes=OVER_ARCH,
            dense_device=torch.device("cpu"),
        )
    )
    apply_optimizer_in_backward(torch.optim.SGD, train.model.sparse_arch.parameters(), {"lr": LR})
    sharder = SHARDERS[sharder_name]()
    topology = Topology(world_size=WORLD_SIZE, local_world_size=WORLD_SIZE, compute_device="cpu")
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size).collective_plan(
        train, [EmbeddingBagCollectionSharder()], dist.GroupMember.WORLD
    )
    kinds = {p.sharding_type for module in plan.plan.values() for p in module.values()}  # type: ignore[attr-defined]
    assert kinds == {"table_wise"}, f"TorchRec's plan is no longer all table-wise: {kinds}"
    model = DistributedModelParallel(train, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda p: torch.optim.SGD(p, lr=LR)
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    return TrainPipelineSparseDist(model, optimizer, torch.device("cpu")), model


def _batches(batch_size: int, seed: int) -> Iterator[Any]:
    """dlrm_main.py's random data (its dataloader's RandomRecDataset), endless."""
    return iter(
        RandomRecDataset(
            keys=DEFAULT_CAT_NAMES,
            batch_size=batch_size,
            hash_size=ROWS,
            ids_per_feature=1,
            num_dense=len(DEFAULT_INT_NAMES),
            manual_seed=seed,
        )
    )


def _steps(pipeline: TrainPipelineSparseDist, batches: Iterator[Any], n: int) -> tuple[float, float]:
    """The median wall ms and the median CPU ms of this thread (what other processes' load changes least) of n steps,
    every step started together on both ranks."""
    wall, cpu = [], []
    for _ in range(n):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        pipeline.progress(batches)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.thread_time() - start_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def _top(profile: cProfile.Profile, steps: int, top: int) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """Function calls per step, the top functions by own time, and our package's functions by cumulative time (calls
    and us per step)."""
    stats = pstats.Stats(profile)
    rows, ours = [], []
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = path.split("site-packages/")[-1].split("/embark_torchrec/")[-1]
        row = {"function": f"{where}:{line}({name})", "calls": calls / steps, "own_us": own / steps * 1e6}
        rows.append(row)
        if "/embark_torchrec/" in path:
            ours.append(row | {"cum_us": cum / steps * 1e6})
    rows.sort(key=lambda r: -r["own_us"])
    ours.sort(key=lambda r: -r["cum_us"])
    return stats.total_calls // steps, rows[:top], ours[:top]  # type: ignore[attr-defined]


def _run(rounds: int, steps: int, batch_size: int, top: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    runs = {name: _model(name, batch_size) for name in SHARDERS}
    feeds = {name: _batches(batch_size, seed=rank) for name in SHARDERS}
    found: dict[str, Any] = {}
    for name, (pipeline, _) in runs.items():
        _steps(pipeline, feeds[name], 5)  # warm-up: lazily built dists, the pipeline filled
        counters = []
        for _ in range(COUNTED_STEPS):
            with HostWorkCounter() as counter:
                pipeline.progress(feeds[name])
            counters.append(counter)
        profile = cProfile.Profile()
        profile.enable()
        _steps(pipeline, feeds[name], steps)
        profile.disable()
        calls, functions, package = _top(profile, steps, top)
        found[name] = {
            "aten_ops": statistics.median(c.aten_ops for c in counters),
            "host_syncs": statistics.median(c.host_syncs for c in counters),
            "collectives": statistics.median(c.collectives for c in counters),
            "blocking_collectives": statistics.median(c.blocking_collectives for c in counters),
            "sync_ops": dict(counters[-1].sync_ops),
            "collective_ops": dict(counters[-1].collective_ops),
            "python_calls": calls,
            "top": functions,
            "embark_torchrec": package,
            "ms_per_round": [],
            "cpu_ms_per_round": [],
        }
    loads = []
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        for name in list(SHARDERS) if r % 2 == 0 else list(SHARDERS)[::-1]:
            wall, cpu = _steps(runs[name][0], feeds[name], steps)
            found[name]["ms_per_round"].append(wall)
            found[name]["cpu_ms_per_round"].append(cpu)
    ratios = {
        key: [o / t for o, t in zip(found["ours"][key], found["torchrec"][key])]
        for key in ("ms_per_round", "cpu_ms_per_round")
    }
    return {"rank": rank, "by_sharder": found, "ratios": ratios, "loads": loads}


def _markdown(result: dict[str, Any]) -> str:
    found = result["by_sharder"]
    lines = [
        "| sharder | aten ops | host syncs | collectives | blocking | Python calls | wall ms/step | CPU ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in found.items():
        lines.append(
            f"| {name} | {f['aten_ops']:g} | {f['host_syncs']:g} | {f['collectives']:g} | "
            f"{f['blocking_collectives']:g} | {f['python_calls']} | {statistics.median(f['ms_per_round']):.2f} | "
            f"{statistics.median(f['cpu_ms_per_round']):.2f} |"
        )
    loads = result["loads"]
    lines.append("")
    for key, what in (("ms_per_round", "wall"), ("cpu_ms_per_round", "rank 0's CPU")):
        ratios = result["ratios"][key]
        lines.append(
            f"ours / TorchRec's {what} time per step: median of per-round ratios {statistics.median(ratios):.3f} "
            f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})"
        )
    lines.append(f"1-min load average during the rounds {min(loads):.2f}-{max(loads):.2f}")
    for name, f in found.items():
        lines += ["", f"{name}: top functions by own time per step (rank 0, cProfile)", ""]
        lines += ["| function | calls | us |", "|---|---:|---:|"]
        lines += [f"| `{t['function']}` | {t['calls']:g} | {t['own_us']:.0f} |" for t in f["top"]]
    package = found["ours"]["embark_torchrec"]
    lines += ["", "ours: embark_torchrec's functions by cumulative time per step (rank 0, cProfile)", ""]
    lines += ["| function | calls | cumulative us |", "|---|---:|---:|"]
    lines += [f"| `{t['function']}` | {t['calls']:g} | {t['cum_us']:.0f} |" for t in package]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=30, help="steps per round (and profiled)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (dlrm_main.py's default)")
    p.add_argument("--top", type=int, default=12, help="functions listed per sharder")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = run_ranks(_run, WORLD_SIZE, timeout_s=3600, args=(args.rounds, args.steps, args.batch_size, args.top))[0]
    print(_markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
