"""What our grid sharding costs against torchrec's built-in sharding for the same layout.

--layout twrw (default): every table table-row-wise (rows split in torchrec's ceil blocks over one
node's ranks, partial sums reduced inside the node first); torchrec runs it as "table_row_wise", we
run the identical layout as "embark_rb_hier" (GridPooledEmbeddingSharding, hierarchical output).
--layout tw: table i on rank i mod 4; torchrec's "table_wise" against our flat "embark_rb".
Both train with the same fused SGD on the same batches, on 4 gloo ranks as 2 nodes x 2, in
interleaved rounds; we print median step times and their ratio.

    python benchmarks/runtime_overhead.py [--layout twrw|tw] [--rounds 7] [--steps 10] [--batch-per-rank 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.search.baselines import table_row_wise_plan
from embark_torchrec.plan.layout.groups import ShardingGroup
from embark_torchrec.plan.layout.tables import Plan, TableLayout
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.plan.model.topology import Topology, hardware_preset
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.training import SparseArch

WORLD_SIZE, LOCAL_WORLD_SIZE = 4, 2
BUILTIN = {"twrw": "table_row_wise", "tw": "table_wise"}


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=20_000 * (i + 1), feature_names=[f"f{i}"])
        for i in range(8)
    ]


def _plan(spec: ModelSpec, layout: str) -> Plan:
    topology = Topology(WORLD_SIZE, LOCAL_WORLD_SIZE, hardware_preset("cpu-gloo"))
    if layout == "twrw":
        return table_row_wise_plan(spec, topology)
    return Plan(
        WORLD_SIZE,
        LOCAL_WORLD_SIZE,
        {t.name: TableLayout.table_wise(t.rows, t.dim, i % WORLD_SIZE) for i, t in enumerate(spec.tables)},
    )


def _model(tables: list[EmbeddingBagConfig], layout: str, ours: bool) -> torch.nn.Module:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    meta = SparseArch(tables, False, torch.device("meta"))
    spec = ModelSpec.from_module(meta.ebc, batch_size=WORLD_SIZE)
    plan = _plan(spec, layout)
    module_plan = module_sharding_plan(plan, spec, "cpu")
    assert all(ps.sharding_type == BUILTIN[layout] for ps in module_plan.values())
    if ours:
        for name, ps in module_plan.items():
            module_plan[name] = dataclasses.replace(ps, sharding_type=ShardingGroup.ours(plan[name]).name)
    sharder = EmbarkEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.01})
    return DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"ebc": module_plan}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )


def _time_steps(model: torch.nn.Module, batches: list, steps: int) -> float:
    """Median over steps of the slowest rank's forward + backward, in ms."""
    rank = dist.get_rank()
    times = []
    for i in range(steps):
        dist.barrier()
        start = time.perf_counter()
        out = model(batches[i % len(batches)][rank])
        out = out.wait() if hasattr(out, "wait") else out
        out.values().sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed) * 1e3)
    return statistics.median(times)


def _run(layout: str, rounds: int, steps: int, batch_per_rank: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    tables = _tables()
    batches = [global_kjt_batch(tables, WORLD_SIZE, batch_per_rank, seed=s, max_bag_size=20) for s in range(4)]
    models = {
        f"torchrec {BUILTIN[layout]}": _model(tables, layout, ours=False),
        "embark": _model(tables, layout, ours=True),
    }
    for model in models.values():  # warm-up
        _time_steps(model, batches, 2)
    results: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            results[name].append(_time_steps(model, batches, steps))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=sorted(BUILTIN), default="twrw")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-per-rank", type=int, default=256)
    args = p.parse_args()
    results = run_ranks(
        _run,
        WORLD_SIZE,
        local_world_size=LOCAL_WORLD_SIZE,
        timeout_s=1800,
        args=(args.layout, args.rounds, args.steps, args.batch_per_rank),
    )[0]
    medians = {name: statistics.median(v) for name, v in results.items()}
    print(
        f"layout {args.layout}: 4 gloo ranks (2 nodes x 2), 8 tables x 64 dims, batch {args.batch_per_rank}/rank, "
        f"{args.rounds} interleaved rounds of {args.steps} steps"
    )
    print("| sharding | median step ms | per-round medians |")
    print("|---|---:|---|")
    for name, v in results.items():
        print(f"| {name} | {medians[name]:.2f} | {', '.join(f'{x:.1f}' for x in v)} |")
    ratio = medians["embark"] / medians[f"torchrec {BUILTIN[args.layout]}"]
    print(f"ratio embark / torchrec = {ratio:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
