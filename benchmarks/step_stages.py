"""Where a step's time goes, rank by rank, beside the cost model's phases: a kept sweep model's embark and TorchRec
plans run in interleaved rounds with the example's --stage-times, each rank's step split into its stages (making the
batch, the input dists, the forward and its waits for the output dists' exchanges, the backward and its waits for the
gradients'), next to what the cost model prices that rank at (its lookups, and the network time of each phase: the
IDs', the forward's and the gradients', and the paired premium). A plan whose step misses its price shows here which
stage holds the difference, and where the runtime does not run the phases the model adds up (TorchRec's pipeline
sends the next batch's IDs during this step's backward).

    PYTHONPATH=. .venv/bin/python benchmarks/step_stages.py --sweep benchmarks/sweep8.md --seed 2101431386
        [--rounds 2] [--out benchmarks/step_stages.md]

Stage times are medians over the measured steps (after the sweep's warm-up) and then over rounds. Each run's stage
files and the rounds are kept under --out's folder (seed<seed>/); --kept runs nothing and writes the markdown from them.
Needs root (network namespaces), ip and tc.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embark_torchrec.plan import Plan
from embark_torchrec.sharding.stage_times import STAGES

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster_e2e import Rounds, cluster_ready  # noqa: E402 (next to this file)
from sweep import (  # noqa: E402
    RUNS,
    check_kept_model,
    interleaved_rounds,
    kept_cost,
    kept_model_flags,
    kept_model_rounds,
    kept_seeds,
    kept_spec,
    model_folder,
)

PLANS = ("embark", "torchrec")
PHASES = ("lookup", "ids", "forward", "gradients", "paired_premium")  # what the cost model prices each rank at


def stage_folder(folder: Path, run: str, round_index: int) -> Path:
    """Where one run's round writes its ranks' stage times (the example's --stage-times)."""
    return folder / "stages" / run / f"round{round_index + 1}"


def stage_medians(folder: Path, run: str, rounds: int, warmup_steps: int) -> dict[int, dict[str, float]]:
    """Per rank, each stage's median over the steps after the warm-up, then the median of that over the rounds."""
    per_round: dict[int, list[dict[str, float]]] = {}
    for i in range(rounds):
        files = sorted(stage_folder(folder, run, i).glob("rank*.json"))
        if not files:
            raise FileNotFoundError(f"{stage_folder(folder, run, i)}: no rank's stage times")
        for file in files:
            kept = json.loads(file.read_text())
            steps = kept["steps"][warmup_steps:]
            if not steps:
                raise ValueError(f"{file}: {len(kept['steps'])} steps, none after the {warmup_steps} warm-up steps")
            medians = {stage: statistics.median(step[stage] for step in steps) for stage in STAGES}
            per_round.setdefault(int(kept["rank"]), []).append(medians)
    return {
        rank: {stage: statistics.median(r[stage] for r in rounds_of_rank) for stage in STAGES}
        for rank, rounds_of_rank in sorted(per_round.items())
    }


def priced_phases(folder: Path, rounds: dict[str, Any], run: str) -> tuple[float, dict[str, np.ndarray]]:
    """A plan's priced step and, per rank, what the cost model prices its phases at (PHASES, in ms)."""
    cost = kept_cost(folder, kept_spec(folder), rounds)
    plan = Plan.load(folder / f"{run}.plan.json")
    rows = cost.rank_load(plan).rows
    lookup, _, _ = cost.rank_times(rows)
    ids, forward, gradients = cost.phase_network_ms(rows)
    premium = np.maximum(rows[8], rows[9]) * cost.paired_premium_ms_per_byte
    phases = dict(zip(PHASES, (lookup, ids, forward, gradients, premium)))
    return cost.evaluate(plan).step_ms, phases


@dataclass(frozen=True)
class PlanStages:
    """One plan of a model: its priced and measured step, each rank's measured stages and priced phases."""

    run: str
    priced_ms: float
    measured_ms: float
    stages: dict[int, dict[str, float]]
    phases: dict[str, np.ndarray]


def model_stages(folder: Path) -> tuple[dict[str, Any], list[PlanStages]]:
    """A kept model's rounds and its plans' stages beside their prices."""
    rounds = json.loads((folder / "rounds.json").read_text())
    plans = []
    for run in PLANS:
        priced, phases = priced_phases(folder, rounds, run)
        measured = Rounds(rounds["runs"], {run: priced}).measured_ms(run)
        stages = stage_medians(folder, run, len(rounds["runs"][run]), rounds["warmup_steps"])
        plans.append(PlanStages(run, priced, measured, stages, phases))
    return rounds, plans


def markdown(models: list[tuple[dict[str, Any], list[PlanStages]]], note: str) -> str:
    lines = [
        "# Where a step's time goes",
        "",
        "Each rank's step split into its stages, measured in training on the emulated cluster (the example's "
        "`--stage-times`; medians over the measured steps, then over rounds), beside what the cost model prices the "
        "rank at (benchmarks/step_stages.py). An exchange wait is the time the rank sat waiting for the embedding "
        "all-to-alls (ours and TorchRec's) of that stage: the forward's output dists, the backward's gradients; the "
        "forward also waits for its IDs' exchange, and with TorchRec's pipeline the next batch's IDs travel during "
        "the backward. Priced: the rank's lookups and its network time in each phase of the step, which the model "
        "adds up (the IDs', the forward's, the gradients', and the paired premium of the hierarchical stage 2). "
        + note,
    ]
    for rounds, plans in models:
        lines += ["", f"## Seed {rounds['seed']} ({rounds['sweep']})"]
        for p in plans:
            lines += [
                "",
                f"**{p.run}**: priced {p.priced_ms:,.0f} ms, measured {p.measured_ms:,.0f} ms (the step less the "
                "batch making).",
                "",
                "| rank | step | batch | input dists | forward | its exchange waits | backward | its exchange waits | "
                "priced: lookups | IDs | forward | gradients | paired premium |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for rank, s in p.stages.items():
                measured = " | ".join(f"{s[stage]:,.0f}" for stage in STAGES)
                priced = " | ".join(f"{p.phases[phase][rank]:,.0f}" for phase in PHASES)
                lines.append(f"| {rank} | {measured} | {priced} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kept_model_flags(p, ROOT / "benchmarks" / "step_stages.md")
    args = p.parse_args(argv)
    if not args.kept:
        check_kept_model(p, args)
    return args


def run_model(args: argparse.Namespace, folder: Path) -> None:
    """The model's plans in interleaved rounds with their stage times, kept in `folder` (its rounds.json)."""
    source = model_folder(args.sweep, args.seed)
    if folder.exists():
        shutil.rmtree(folder)  # stage files of an earlier run must not mix with these rounds'
    folder.mkdir(parents=True)
    for name in ("spec.json", "hardware.json", *(f"{run}.plan.json" for run in PLANS)):
        shutil.copyfile(source / name, folder / name)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = interleaved_rounds(
            args,
            args.seed,
            folder,
            Path(tmp),
            list(PLANS),
            True,
            {run: RUNS["embark"] for run in PLANS},  # each plan runs as a plan file, with the model's hardware file
            lambda run, i: ("--stage-times", str(stage_folder(folder, run, i))),
        )
    kept = kept_model_rounds(args, runs, time.perf_counter() - start) | {"warmup_steps": args.warmup_steps}
    (folder / "rounds.json").write_text(json.dumps(kept, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kept_folder = args.out.with_suffix("")
    if not args.kept:
        if not cluster_ready("step_stages.py"):
            return 1
        run_model(args, kept_folder / f"seed{args.seed}")
    models = [model_stages(kept_folder / f"seed{seed}") for seed in kept_seeds(kept_folder)]
    minutes = sum(rounds["seconds"] for rounds, _ in models) / 60
    note = f"{minutes:.1f} min of runs in all."
    args.out.write_text(markdown(models, note))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
