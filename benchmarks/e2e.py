"""End to end: the DLRM example on 4 CPU ranks as 2 nodes x 2, planned by embark, TorchRec's default planner
and table-row-wise (TWRW), in interleaved rounds of one run.

Each run is `torchrun --standalone --nproc_per_node 4 examples/dlrm/train.py --local-world-size 2 --planner P`
(same model, same synthetic data, same seed); we parse its RESULT line. Interleaving (embark, torchrec, trw,
embark, ...) spreads the machine's noise over all planners; medians over rounds. Counted bytes are exact
(the same every round); samples/s is a wall-clock measurement. Writes a markdown table (and embeds the
simulated-cluster table of plan_quality.py) and, with --plot, a PNG of each plan's per-rank estimated load
and measured bytes.

    PYTHONPATH=. .venv/bin/python benchmarks/e2e.py [--rounds 3] [--steps 100] [--plot benchmarks/e2e.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from embark_torchrec.plan.cost import CostModel
from embark_torchrec.plan.layout import Plan
from embark_torchrec.plan.spec import ModelSpec
from embark_torchrec.plan.topology import Topology, hardware_preset

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "dlrm" / "train.py"
sys.path.insert(0, str(TRAIN.parent))
from train import default_spec  # noqa: E402 (the example's model, defined once; needs the path above)

PLAN_QUALITY = ROOT / "benchmarks" / "plan_quality.md"
WORLD_SIZE, LOCAL_WORLD_SIZE = 4, 2
# each run: its name -> train.py's planner flags; embark-fp16 is embark's plan with fp16 on the wire
RUNS = {
    "embark": ("--planner", "embark"),
    "embark-fp16": ("--planner", "embark", "--wire-precision", "fp16"),
    "torchrec": ("--planner", "torchrec"),
    "trw": ("--planner", "trw"),
}
PLANNERS = tuple(RUNS)
EMBARK = ("embark", "embark-fp16")
BASELINES = ("torchrec", "trw")
HARDWARE = "cpu-gloo"  # what train.py plans with on CPU
TARGETS = {"inter_node_bytes_per_step": 0.7, "samples_per_s": 0.95}  # embark vs torchrec (issue 6)


def run_example(planner: str, args: argparse.Namespace, plan_out: Path) -> dict[str, Any]:
    """One torchrun job of the example; its RESULT as a dict (raises with the output's tail on failure)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD_SIZE), str(TRAIN),
        *RUNS[planner], "--local-world-size", str(LOCAL_WORLD_SIZE), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--log-every", str(args.steps), "--plan-out", str(plan_out),
    ] + (["--no-pipeline"] if args.no_pipeline else [])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout_s, env=env, cwd=ROOT)
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != 1:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"{planner}: exit {proc.returncode}, {len(results)} RESULT lines\n{tail}")
    return json.loads(results[0])


def medians(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, float]:
    return {p: float(statistics.median(r[key] for r in rs)) for p, rs in runs.items()}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def markdown(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, spec: ModelSpec, seconds: float) -> str:
    """The results table, the ratios of embark to each baseline, the targets, and plan_quality's table."""
    rate = medians(runs, "samples_per_s")
    total = medians(runs, "comm_bytes_per_step")
    inter = medians(runs, "inter_node_bytes_per_step")
    auc = medians(runs, "auc")
    est = medians(runs, "estimated_step_ms")
    title = f"# End to end: the DLRM example on {WORLD_SIZE} CPU ranks as {WORLD_SIZE // LOCAL_WORLD_SIZE} nodes x {LOCAL_WORLD_SIZE} (gloo)"
    rows = [t.rows for t in spec.tables]
    setup = (
        f"Model {spec.name} (train.py's default: {len(rows)} tables of {min(rows):,} to {max(rows):,} rows x "
        f"{spec.tables[0].dim}), synthetic Zipf data, batch {args.batch_size} per rank, {args.steps} steps per run, "
        f"{args.rounds} interleaved rounds of {', '.join(PLANNERS)}, "
        f"{'without pipelining' if args.no_pipeline else 'TrainPipelineSparseDist'}; {seconds / 60:.1f} min in all. "
        "samples/s: median over rounds (each run leaves its warm-up steps out); bytes: per training step, the "
        "maximum over ranks of what a rank sent + received (all embedding collectives; data-parallel tables' "
        "all-reduce runs in DDP with the dense part and is not counted), counted by embark_torchrec.sharding.comm_stats."
    )
    lines = [
        title,
        "",
        setup,
        "",
        "| plan | samples/s | samples/s per round | bytes / step | inter-node bytes / step | held-out AUROC | estimated step ms |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for p in PLANNERS:
        per_round = ", ".join(f"{r['samples_per_s']:,.0f}" for r in runs[p])
        lines.append(
            f"| {p} | {rate[p]:,.0f} | {per_round} | {total[p]:,.0f} | {inter[p]:,.0f} | {auc[p]:.4f} | {est[p]:.2f} |"
        )
    lines += [
        "",
        "| ratio | samples/s | bytes / step | inter-node bytes / step | estimated step ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for e in EMBARK:
        for b in BASELINES:
            lines.append(
                f"| {e} vs {b} | {ratio(rate[e], rate[b])} | {ratio(total[e], total[b])} | "
                f"{ratio(inter[e], inter[b])} | {ratio(est[e], est[b])} |"
            )
    lines.append("")
    for e in EMBARK:
        inter_ok = inter[e] <= TARGETS["inter_node_bytes_per_step"] * inter["torchrec"]
        rate_ok = rate[e] >= TARGETS["samples_per_s"] * rate["torchrec"]
        lines.append(
            f"Targets, {e} against torchrec: inter-node bytes <= {TARGETS['inter_node_bytes_per_step']}x: "
            f"{'met' if inter_ok else 'not met'}; samples/s >= {TARGETS['samples_per_s']}x: {'met' if rate_ok else 'not met'}."
        )
    lines += [
        "",
        f"Reproduce: `{command(args)}`",
    ]
    if PLAN_QUALITY.exists():
        heading = "## Simulated clusters (`benchmarks/plan_quality.py`, from `benchmarks/plan_quality.md`)"
        lines += ["", heading, "", PLAN_QUALITY.read_text().strip()]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict[str, Any]]], plan_files: dict[str, Path], spec: ModelSpec, path: Path) -> None:
    """One row per plan: the cost model's per-rank load (lookups, intra- and inter-node communication, ms)
    and the measured per-rank bytes per step (intra- and inter-node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost_model = CostModel(spec, Topology(WORLD_SIZE, LOCAL_WORLD_SIZE, hardware_preset(HARDWARE)))
    costs = {p: cost_model.evaluate(Plan.load(plan_files[p])) for p in PLANNERS}
    fig, axes = plt.subplots(len(PLANNERS), 2, figsize=(12, 2.8 * len(PLANNERS)), squeeze=False)
    ranks = np.arange(WORLD_SIZE)
    top_ms = max(float(c.rank_load_ms.max()) for c in costs.values()) * 1.05
    steps = {p: max(runs[p][0]["steps_run"], 1) for p in PLANNERS}
    total = {p: np.array(runs[p][0]["comm_bytes_by_rank"]) / steps[p] / 1e6 for p in PLANNERS}
    inter = {p: np.array(runs[p][0]["inter_node_bytes_by_rank"]) / steps[p] / 1e6 for p in PLANNERS}
    top_mb = max(float(t.max()) for t in total.values()) * 1.05 or 1.0
    for row, p in enumerate(PLANNERS):
        c, left, right = costs[p], axes[row, 0], axes[row, 1]
        left.bar(ranks, c.rank_lookup_ms, label="lookup", color="#4c72b0")
        left.bar(ranks, c.rank_intra_ms, bottom=c.rank_lookup_ms, label="intra-node comm", color="#55a868")
        left.bar(ranks, c.rank_inter_ms, bottom=c.rank_lookup_ms + c.rank_intra_ms, label="inter-node comm", color="#c44e52")
        left.set_ylim(0, top_ms)
        left.set_ylabel("ms")
        left.set_title(f"{p}: estimated per-rank load (step {c.step_ms:.2f} ms)")
        right.bar(ranks, total[p] - inter[p], label="intra-node", color="#55a868")
        right.bar(ranks, inter[p], bottom=total[p] - inter[p], label="inter-node", color="#c44e52")
        right.set_ylim(0, top_mb)
        right.set_ylabel("MB / step")
        right.set_title(f"{p}: measured bytes sent + received per rank")
    axes[0, 0].legend(loc="upper right", fontsize="small")
    axes[0, 1].legend(loc="upper right", fontsize="small")
    for ax in axes.flat:
        ax.set_xticks(ranks)
    for ax in axes[-1]:
        ax.set_xlabel("rank")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def command(args: argparse.Namespace) -> str:
    flags = f"--rounds {args.rounds} --steps {args.steps} --batch-size {args.batch_size}"
    flags += " --no-pipeline" if args.no_pipeline else ""
    flags += f" --plot {args.plot}" if args.plot else ""
    return f"PYTHONPATH=. .venv/bin/python benchmarks/e2e.py {flags}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=512, help="per rank")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    p.add_argument("--no-pipeline", action="store_true", help="run the example without TrainPipelineSparseDist")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "e2e.md")
    p.add_argument("--plot", type=Path, help="PNG of per-rank estimated load and measured bytes of each plan")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    spec = default_spec().with_batch_size(args.batch_size * WORLD_SIZE)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PLANNERS}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plan_files = {p: Path(tmp) / f"{p}.json" for p in PLANNERS}
        for i in range(args.rounds):
            for p in PLANNERS:
                result = run_example(p, args, plan_files[p])
                runs[p].append(result)
                print(
                    f"round {i + 1}/{args.rounds} {p}: {result['samples_per_s']:,.0f} samples/s, "
                    f"{result['inter_node_bytes_per_step']:,} inter-node bytes/step, AUROC {result['auc']:.4f}",
                    flush=True,
                )
        if args.plot:
            plot(runs, plan_files, spec, args.plot)
    text = markdown(runs, args, spec, time.perf_counter() - start)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
