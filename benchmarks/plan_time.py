"""Planning time as the model and the cluster grow: what the CLI does (plan_model, then the lower bound
in a cost model of its own, then the report) on synthetic models of 100 to 50,000 tables at a fixed
rank count, and of a fixed table count on 8 to 1,024 ranks (dgx-h100, 8 ranks per node, global batch
65,536). Prints a markdown table: wall and CPU seconds of it all and CPU seconds of the bound (medians
of --repeats runs; cases slower than --once-above-s run once), split rounds, polish moves and
improvement moves (phase 3, whose fixed budget of priced candidates is part of every case's time),
estimated step time.

    PYTHONPATH=. python benchmarks/plan_time.py            # the full table, about 10 minutes
    PYTHONPATH=. python benchmarks/plan_time.py --quick    # a small subset, under a minute

Timings depend on the machine and on what else runs on it (CPU seconds less so than wall seconds);
the rounds and the step times do not: planning is deterministic.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from embark_torchrec.plan.cost.bound import step_lower_bound
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.plan_model import PlannedModel, plan_model
from embark_torchrec.plan.report import ScoredPlan, render
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology, hardware_preset

HARDWARE = "dgx-h100"
LOCAL_WORLD_SIZE = 8
BATCH_SIZE = 65536
LARGE_TABLE_SHARE = 1e-3  # a model of N tables has about N / 1000 large ones, and at least one


def synthetic_spec(tables: int, seed: int = 0) -> ModelSpec:
    """A model of `tables` tables that fits 128 ranks even at 50,000 tables: rows log-uniform in
    1e3..1e6, one table in a thousand (and the first) 1e7..1e8; dim a multiple of 4 in 16..256;
    pooling 1..50 IDs per sample; Zipf(1.1) IDs."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(tables):
        large = i == 0 or rng.random() < LARGE_TABLE_SHARE
        rows = int(10 ** rng.uniform(7, 8) if large else 10 ** rng.uniform(3, 6))
        specs.append(TableSpec(f"t{i}", rows, int(4 * rng.integers(4, 65)), float(rng.integers(1, 51))))
    return ModelSpec(f"synthetic{tables}", BATCH_SIZE, tuple(specs), IdDistribution("zipf", 1.1))


def topology(world_size: int) -> Topology:
    return Topology(world_size, min(LOCAL_WORLD_SIZE, world_size), hardware_preset(HARDWARE))


@dataclass(frozen=True)
class Timing:
    tables: int
    ranks: int
    seconds: list[float]
    cpu_seconds: list[float]
    bound_cpu_seconds: list[float]
    planned: PlannedModel

    def row(self) -> str:
        stats = self.planned.stats
        return (
            f"| {self.tables:,} | {self.ranks:,} | {statistics.median(self.seconds):.1f} | "
            f"{statistics.median(self.cpu_seconds):.1f} | {statistics.median(self.bound_cpu_seconds):.1f} | "
            f"{len(self.seconds)} | {stats.rounds if stats else 0} | "
            f"{stats.moves if stats else 0} | {stats.improve_moves if stats else 0} | {self.planned.cost.step_ms:.2f} |"
        )


def measure(tables: int, ranks: int, repeats: int, once_above_s: float) -> Timing:
    spec, topo = synthetic_spec(tables), topology(ranks)
    seconds: list[float] = []
    cpu_seconds: list[float] = []
    bound_cpu_seconds: list[float] = []
    while len(seconds) < repeats:
        start, cpu_start = time.perf_counter(), time.process_time()
        planned = plan_model(spec, topo, progress=False)
        bound_start = time.process_time()
        bound = step_lower_bound(CostModel(spec, topo))
        bound_cpu_seconds.append(time.process_time() - bound_start)
        render([ScoredPlan("embark", planned.plan, planned.cost, planned.seconds, bound)], topo, spec.name)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
        if seconds[0] > once_above_s:
            break
    return Timing(tables, ranks, seconds, cpu_seconds, bound_cpu_seconds, planned)


def cases(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(tables, ranks): the tables sweep at --ranks, then the ranks sweep at --tables, each case once."""
    pairs = [(n, args.ranks) for n in args.table_counts] + [(args.tables, w) for w in args.rank_counts]
    return list(dict.fromkeys(pairs))


def markdown(timings: Iterable[Timing], args: argparse.Namespace) -> str:
    lines = [
        f"Planning time of synthetic models ({HARDWARE}, {LOCAL_WORLD_SIZE} ranks per node, global batch "
        f"{BATCH_SIZE:,}): wall and CPU seconds of plan_model, the lower bound and the report, and CPU seconds "
        "of the bound alone, medians of the runs.",
        "",
        "| tables | ranks | wall s | CPU s | bound CPU s | runs | split rounds | polish moves | improve moves "
        "| estimated step ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(t.row() for t in timings),
        "",
        f"Reproduce: `PYTHONPATH=. python benchmarks/plan_time.py {reproduce(args)}`",
    ]
    return "\n".join(lines) + "\n"


def reproduce(args: argparse.Namespace) -> str:
    """The arguments that plan these cases again: --quick, or the sweeps and the repeats."""
    if args.quick:
        return "--quick"
    sweeps = (("--table-counts", args.table_counts), ("--rank-counts", args.rank_counts))
    flags = " ".join(f"{flag} {','.join(map(str, counts))}" for flag, counts in sweeps)
    return f"{flags} --ranks {args.ranks} --tables {args.tables} --repeats {args.repeats}"


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table-counts", type=csv_ints, default=[100, 1000, 5000, 50000], help="the tables sweep")
    p.add_argument("--ranks", type=int, default=128, help="ranks of the tables sweep")
    p.add_argument("--rank-counts", type=csv_ints, default=[8, 64, 128, 1024], help="the ranks sweep")
    p.add_argument("--tables", type=int, default=1000, help="tables of the ranks sweep")
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the median is reported")
    p.add_argument("--once-above-s", type=float, default=60.0, help="cases slower than this run once")
    p.add_argument("--quick", action="store_true", help="100 and 1,000 tables at 128 ranks, 1,000 tables at 8 ranks")
    p.add_argument("--out", type=Path, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.table_counts, args.rank_counts = [100, 1000], [8]
    return args


def main(argv: Iterable[str] | None = None) -> None:
    args = parse_args(argv)
    timings = []
    for tables, ranks in cases(args):
        timing = measure(tables, ranks, args.repeats, args.once_above_s)
        print(f"{tables} tables on {ranks} ranks: {', '.join(f'{s:.1f}' for s in timing.seconds)} s", flush=True)
        timings.append(timing)
    table = markdown(timings, args)
    if args.out:
        args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
