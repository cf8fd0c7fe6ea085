"""Sequence embeddings: the history table as EmbarkPlanner plans it against row-wise, and embark against TorchRec's
default plan, on the sequence example (examples/sequence/train.py) on CPU ranks grouped into simulated nodes (default
4 ranks as 2 nodes x 2).

Each round runs, in this order, `torchrun ... examples/sequence/train.py --local-world-size L` with
- embark: our sharders, every table (the history table too) as EmbarkPlanner plans it: the example's default
  `--history-layout planned`, no flag (the table's "history sharding" column says what it chose);
- embark-rw: the same with the history table row-wise (TorchRec's even row blocks, run on our grid sharding so that
  the same counters count it: every ID goes to its row's holder and one fp32 row per ID comes back, as in
  TorchRec's row-wise);
- torchrec: TorchRec's EmbeddingShardingPlanner with TorchRec's sharders (not counted: its EC all-to-alls have no
  counters).
Same model, data and seed everywhere; we parse each RESULT line. Counted bytes are exact (the same every round);
samples/s is wall-clock: medians over rounds, and the median of each round's embark / torchrec ratio (interleaving
spreads the machine's noise over the runs). Writes a markdown table.

    PYTHONPATH=. .venv/bin/python benchmarks/sequence_bytes.py [--rounds 3] [--steps 100] [--batch-size 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "sequence" / "train.py"
OUT = ROOT / "benchmarks" / "sequence_bytes.md"
TIMEOUT_S = 400.0
RUNS = {
    "embark": ("--planner", "embark"),  # the example's default: the history table as planned
    "embark-rw": ("--planner", "embark", "--history-layout", "rw"),
    "torchrec": ("--planner", "torchrec"),
}
BYTES_TARGET = 0.5  # the planned history table's counted bytes against row-wise's (issue 15)
RATE_TARGET = 1.0  # embark's samples/s against TorchRec's default plan (issue 15)


def run_example(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun job of the example; its RESULT as a dict (raises with the output's tail on failure)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world_size),
        str(TRAIN), *RUNS[name], "--local-world-size", str(args.local_world_size), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--log-every", str(args.steps),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout_s, env=env, cwd=ROOT)
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != 1:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"{name}: exit {proc.returncode}, {len(results)} RESULT lines\n{tail}")
    return json.loads(results[0])


def _bytes(value: int | None) -> str:
    return "not counted" if value is None else f"{value:,}"


def markdown(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, seconds: float) -> str:
    """The table: per run, its history sharding, median samples/s (and range), counted bytes per step; then the two
    ratios against their targets."""
    lines = [
        f"# Sequence example: planned vs row-wise bytes, embark vs TorchRec samples/s ({args.world_size} ranks as "
        f"{args.world_size // args.local_world_size} nodes x {args.local_world_size})",
        "",
        "embark: every table as EmbarkPlanner plans it (the history table too: the example's default "
        "`--history-layout planned`); embark-rw: the same with the history table forced row-wise "
        "(`--history-layout rw`); torchrec: TorchRec's default planner and sharders.",
        "",
        f"examples/sequence/train.py defaults (history: Zipf(1.1) IDs over 1,000,000 rows x 32, lengths 1-100, "
        f"mean 50.5; 3 pooled tables), batch {args.batch_size} per rank, {args.steps} steps, {args.rounds} "
        f"interleaved rounds, CPU gloo, {seconds / 60:.1f} min in all.",
        "",
        "| run | history sharding | samples/s (median) | min - max | history bytes/step (all ranks) "
        "| comm bytes/step (max rank) | inter-node bytes/step (max rank) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, rs in runs.items():
        rates = [r["samples_per_s"] for r in rs]
        first = rs[0]
        lines.append(
            f"| {name} | {first['history_sharding']} | {statistics.median(rates):,.0f} | "
            f"{min(rates):,.0f} - {max(rates):,.0f} | {_bytes(first['history_bytes_per_step'])} | "
            f"{_bytes(first['comm_bytes_per_step'])} | {_bytes(first['inter_node_bytes_per_step'])} |"
        )
    lines.append("")
    if "embark" in runs and "embark-rw" in runs:
        planned, rw = runs["embark"][0]["history_bytes"], runs["embark-rw"][0]["history_bytes"]
        verdict = "met" if planned < BYTES_TARGET * rw else "NOT met"
        lines.append(
            f"- history table, counted bytes planned ({runs['embark'][0]['history_sharding']}) / row-wise: "
            f"**{planned / rw:.3f}x** (target < {BYTES_TARGET}x: {verdict})"
        )
    if "embark" in runs and "torchrec" in runs:
        per_round = [e["samples_per_s"] / t["samples_per_s"] for e, t in zip(runs["embark"], runs["torchrec"])]
        med = statistics.median(per_round)
        medians = [statistics.median(r["samples_per_s"] for r in runs[n]) for n in ("embark", "torchrec")]
        verdict = "met" if med >= RATE_TARGET else "NOT met"
        lines.append(
            f"- samples/s embark / torchrec: median of per-round ratios **{med:.3f}x** "
            f"(rounds: {', '.join(f'{x:.3f}' for x in per_round)}; ratio of medians {medians[0] / medians[1]:.3f}x; "
            f"target >= {RATE_TARGET}x: {verdict})"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="ranks (torchrun's --nproc_per_node)")
    p.add_argument("--local-world-size", type=int, default=2, help="ranks per simulated node")
    p.add_argument(
        "--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}; each round in that order"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help="per run")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    given = args.runs.split(",")
    unknown = sorted(set(given) - set(RUNS))
    if unknown:
        p.error(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    args.runs = tuple(r for r in RUNS if r in given)
    if args.world_size < 1 or args.local_world_size < 1 or args.world_size % args.local_world_size:
        p.error(f"--local-world-size {args.local_world_size} does not divide --world-size {args.world_size}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in args.runs}
    start = time.perf_counter()
    for i in range(args.rounds):
        for name in args.runs:
            result = run_example(name, args)
            runs[name].append(result)
            print(
                f"round {i + 1}/{args.rounds} {name}: {result['samples_per_s']:,.0f} samples/s, "
                f"history bytes/step {_bytes(result['history_bytes_per_step'])}",
                flush=True,
            )
    text = markdown(runs, args, time.perf_counter() - start)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
