"""End to end: the DLRM example on CPU ranks grouped into simulated nodes (default 4 ranks as 2 nodes x 2),
planned by embark, TorchRec's default planner and table-row-wise (TWRW), in interleaved rounds of one run.

Each run is `torchrun --standalone --nproc_per_node N examples/dlrm/train.py --local-world-size L --planner P
[--model SPEC]` (same model, same synthetic data, same seed); we parse its RESULT line. Interleaving (embark,
torchrec, trw, then trw, torchrec, embark, ...: every other round in reverse, so that no planner always runs
first) spreads the machine's noise over all planners; medians over rounds. Counted bytes
are exact (the same every round); samples/s is a wall-clock measurement. `embark-no-ub` runs embark's plan of
the same round with its unique-based (UB) tables made row-based (RB): whether UB, where embark chooses it, is
faster than the same tables without it. Writes a markdown table (and embeds the simulated-cluster table of
plan_quality.py) and, with --plot, a PNG of each plan's per-rank estimated load and measured bytes.

    PYTHONPATH=. .venv/bin/python benchmarks/e2e.py [--model benchmarks/models/dlrm_main.json]
        [--world-size 4] [--local-world-size 2] [--planners embark,embark-no-ub,torchrec]
        [--rounds 3] [--steps 100] [--plot benchmarks/e2e.png] [--calibrate | --hardware FILE]

--calibrate first runs the example once with its --calibrate (python -m embark_torchrec.calibrate's figures plus
this model's dense part, measured on the same ranks) and plans every run with that hardware file; --hardware
plans every run with a given one. Each run's estimated step (the cost model's, for the plan that ran) is set
against its measured step less the time its ranks spent making batches, which no plan changes.
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.tables import Plan
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.plan.model.topology import Topology, hardware_preset

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "dlrm" / "train.py"
sys.path.insert(0, str(TRAIN.parent))
from train import load_spec  # noqa: E402 (the example's models, defined once; needs the path above)

PLAN_QUALITY = ROOT / "benchmarks" / "plan_quality.md"
OUT = ROOT / "benchmarks" / "e2e.md"
TIMEOUT_S = 300.0
# each run: its name -> train.py's planner flags, in the order a round runs them; embark-fp16 is embark's plan
# with fp16 on the wire; embark-no-ub runs (--plan-in) embark's plan of the same round without UB, so it follows embark
RUNS = {
    "embark": ("--planner", "embark"),
    "embark-no-ub": (),
    "embark-fp16": ("--planner", "embark", "--wire-precision", "fp16"),
    "torchrec": ("--planner", "torchrec"),
    "trw": ("--planner", "trw"),
}
NO_UB = "embark-no-ub"
DEFAULT_PLANNERS = ("embark", "embark-fp16", "torchrec", "trw")
EMBARK = ("embark", "embark-fp16")
BASELINES = ("torchrec", "trw")
HARDWARE = "cpu-gloo"  # what train.py plans with on CPU
RATE_TARGET = 0.97  # embark's samples/s against torchrec's (issue 12's acceptance)
ESTIMATE_TARGET = 0.25  # |estimated / measured step - 1| of embark's plan on calibrated hardware (issue 16)
INTER_TARGET = 0.7  # embark-fp16's inter-node bytes against torchrec's (issue 6)


def run_example(
    planner: str, args: argparse.Namespace, plan_out: Path, plan_in: Path | None = None, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """One torchrun job of the example (`extra`: more of its flags); its RESULT as a dict (raises with the output's
    tail on failure). `args.launcher`, where set (cluster_e2e.py: the emulated cluster), is the command that starts
    the ranks instead of torchrun --standalone on this box."""
    model = (
        []
        if args.model is None
        else ["--model", str(Path(args.model).resolve()) if Path(args.model).exists() else args.model]
    )
    launcher = getattr(args, "launcher", None) or [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world_size)
    ]  # fmt: skip
    cmd = [
        *launcher, str(TRAIN), *RUNS[planner], *model, "--local-world-size", str(args.local_world_size),
        "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--log-every", str(args.steps), "--plan-out", str(plan_out),
    ] + (["--plan-in", str(plan_in)] if plan_in else []) + (["--no-pipeline"] if args.no_pipeline else [])  # fmt: skip
    cmd += [*extra, "--hardware", str(args.hardware)] if args.hardware else list(extra)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout_s, env=env, cwd=ROOT)
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != 1:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"{planner}: exit {proc.returncode}, {len(results)} RESULT lines\n{tail}")
    return json.loads(results[0])


def calibrate(args: argparse.Namespace, tmp: Path) -> Path:
    """The hardware file of one calibration job of the example on the runs' ranks (python -m
    embark_torchrec.calibrate's figures and the model's dense part), kept next to --out."""
    once = argparse.Namespace(**{**vars(args), "hardware": None, "steps": 2})
    quick = ("quick",) if getattr(args, "quick_calibration", False) else ()  # cluster_e2e.py's --quick-calibration
    run_example("embark", once, tmp / "calibration.json", extra=("--calibrate", *quick))
    kept = args.out.with_suffix(".hardware.json")
    kept.write_text((tmp / "calibration.hardware.json").read_text())
    return kept


def calibrate_dense(args: argparse.Namespace, tmp: Path, name: str) -> Path:
    """`args.hardware` (a cluster calibrated on the runs' ranks) with this model's dense part measured on those
    ranks (the example's --calibrate dense: seconds, where the cluster's calibration takes minutes)."""
    once = argparse.Namespace(**{**vars(args), "steps": 2})
    run_example("embark", once, tmp / f"{name}.json", extra=("--calibrate", "dense"))
    return tmp / f"{name}.hardware.json"


def hardware_note(args: argparse.Namespace) -> str:
    """Which hardware file the runs planned with, and where it came from."""
    where = "measured by the example's --calibrate before the rounds" if args.calibrate else "given"
    return f"`{args.hardware}` ({where})"


def without_ub(plan_file: Path, out: Path) -> None:
    """The plan with every UB table made RB (same shards, precision and hierarchy), so that the two runs differ
    only in the cluster of those tables."""
    plan = Plan.load(plan_file)
    rb = {name: replace(t, cluster="rb") for name, t in plan.tables.items() if t.cluster == "ub"}
    replace(plan, tables={**plan.tables, **rb}).save(out)


def cluster_counts(plan_file: Path) -> dict[str, int]:
    """Tables per cluster of a plan, most first."""
    return dict(Counter(t.cluster for t in Plan.load(plan_file).tables.values()).most_common())


def medians(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, float]:
    return {p: float(statistics.median(r[key] for r in rs)) for p, rs in runs.items()}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def round_ratio(runs: dict[str, list[dict[str, Any]]], a: str, b: str, key: str) -> float:
    """The median over rounds of a's value / b's in the same round: runs next to each other in time share the
    machine's load, which drifts over a run of many minutes."""
    return float(statistics.median(round_ratios(runs, a, b, key)))


def round_ratios(runs: dict[str, list[dict[str, Any]]], a: str, b: str, key: str) -> list[float]:
    """a's value / b's, round by round."""
    return [x[key] / y[key] for x, y in zip(runs[a], runs[b])]


def describe(spec: ModelSpec, model: str | None) -> str:
    """The model the runs train, from its spec: where it comes from, tables, rows, dims, poolings, IDs."""

    def span(values: Sequence[float], fmt: Callable[[float], str]) -> str:
        lo, hi = min(values), max(values)
        return fmt(lo) if lo == hi else f"{fmt(lo)} to {fmt(hi)}"

    tables = spec.tables
    source = model or "train.py's default"
    dists = dict.fromkeys(spec.distribution(t) for t in tables)
    ids = " and ".join("uniform" if d.kind == "uniform" else f"Zipf({d.alpha:g})" for d in dists)
    return (
        f"Model {spec.name} ({source}: {len(tables)} tables of "
        f"{span([t.rows for t in tables], lambda v: f'{v:,}')} rows x {span([t.dim for t in tables], str)}, "
        f"pooling {span([t.pooling for t in tables], lambda v: f'{v:g}')}, {ids} IDs)"
    )


def no_ub_note(runs: dict[str, list[dict[str, Any]]]) -> str | None:
    """Rounds where embark-no-ub ran embark's plan unchanged, as a sentence (None: UB in every round)."""
    same = sum(not r["clusters"].get("ub") for r in runs["embark"])
    if not same:
        return None
    if same == len(runs["embark"]):
        return "Note: embark's plan has no unique-based table, so embark-no-ub ran the same plan as embark."
    return (
        f"Note: embark's plan has no unique-based table in {same} of {len(runs['embark'])} rounds, "
        "so embark-no-ub ran the same plan as embark there."
    )


def markdown(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, spec: ModelSpec, seconds: float) -> str:
    """The results table, the ratios of embark to each baseline (and to itself without UB), the targets,
    and plan_quality's table."""
    planners = args.planners
    rate = medians(runs, "samples_per_s")
    total = medians(runs, "comm_bytes_per_step")
    inter = medians(runs, "inter_node_bytes_per_step")
    auc = medians(runs, "auc")
    est = medians(runs, "estimated_step_ms")
    measured = {p: float(statistics.median(r["step_ms"] - r["data_ms_per_step"] for r in rs)) for p, rs in runs.items()}
    ws, lws = args.world_size, args.local_world_size
    title = f"# End to end: the DLRM example on {ws} CPU ranks as {ws // lws} nodes x {lws} (gloo)"
    setup = (
        f"{describe(spec, args.model)}, synthetic data, batch {args.batch_size} per rank, {args.steps} steps per run, "
        f"{args.rounds} interleaved rounds of {', '.join(planners)} (every other round in reverse order), "
        f"{'without pipelining' if args.no_pipeline else 'TrainPipelineSparseDist'}; {seconds / 60:.1f} min in all. "
        + (
            "embark-no-ub: embark's plan of the same round with every unique-based (ub) table made row-based (rb), "
            "same shards and precision, run from the plan file. "
            if NO_UB in planners
            else ""
        )
        + (f"Every run planned with the hardware file {hardware_note(args)}. " if args.hardware else "")
        + "samples/s: median over rounds (each run leaves out its warm-up steps and, pipelined, its last step, "
        "which distributes no next batch); bytes: per training step, the "
        "maximum over ranks of what a rank sent + received (all embedding collectives; data-parallel tables' "
        "all-reduce runs in DDP with the dense part and is not counted), "
        "counted by embark_torchrec.sharding.comm_stats; "
        "clusters: tables per cluster of the plan that ran; measured step ms: median over rounds of the step "
        "less the time the slowest rank spent making a batch (no plan changes it), against the cost model's "
        "estimated step for the plan that ran."
    )
    lines = [
        title,
        "",
        setup,
        "",
        "| plan | clusters | samples/s | samples/s per round | bytes / step | inter-node bytes / step | held-out AUROC "
        "| estimated step ms | measured step ms | estimated / measured |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in planners:
        clusters = " / ".join(dict.fromkeys(", ".join(f"{c} {n}" for c, n in r["clusters"].items()) for r in runs[p]))
        per_round = ", ".join(f"{r['samples_per_s']:,.0f}" for r in runs[p])
        lines.append(
            f"| {p} | {clusters} | {rate[p]:,.0f} | {per_round} | {total[p]:,.0f} | {inter[p]:,.0f} "
            f"| {auc[p]:.4f} | {est[p]:.2f} | {measured[p]:.2f} | {ratio(est[p], measured[p])} |"
        )
    pairs = [(e, b) for e in EMBARK for b in BASELINES if e in planners and b in planners]
    pairs += [("embark", NO_UB)] if NO_UB in planners else []
    if pairs:
        lines += [
            "",
            "| ratio | samples/s (median of per-round ratios) | samples/s (ratio of medians) | bytes / step "
            "| inter-node bytes / step | estimated step ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    for a, b in pairs:
        lines.append(
            f"| {a} vs {b} | {round_ratio(runs, a, b, 'samples_per_s'):.2f}x | {ratio(rate[a], rate[b])} | "
            f"{ratio(total[a], total[b])} | "
            f"{ratio(inter[a], inter[b])} | {ratio(est[a], est[b])} |"
        )
    note = no_ub_note(runs) if NO_UB in planners else None
    lines += ["", note] if note else []
    targets = []
    if {"embark", "torchrec"} <= set(planners):
        per_round = round_ratio(runs, "embark", "torchrec", "samples_per_s")
        met = per_round >= RATE_TARGET
        targets.append(
            f"Target, embark against torchrec: samples/s >= {RATE_TARGET}x (median of per-round ratios): "
            f"{per_round:.2f}x, {'met' if met else 'not met'}."
        )
    if {"embark-fp16", "torchrec"} <= set(planners):
        met = inter["embark-fp16"] <= INTER_TARGET * inter["torchrec"]
        targets.append(
            f"Target, embark-fp16 against torchrec: inter-node bytes <= {INTER_TARGET}x: {'met' if met else 'not met'}."
        )
    if "embark" in planners and args.hardware:
        off = est["embark"] / measured["embark"] - 1
        targets.append(
            f"Target, embark's estimated step within {ESTIMATE_TARGET:.0%} of its measured step on calibrated "
            f"hardware: {off:+.0%}, {'met' if abs(off) <= ESTIMATE_TARGET else 'not met'}."
        )
    lines += ["", *targets] if targets else []
    lines += [
        "",
        f"Reproduce: `{command(args)}`",
    ]
    if PLAN_QUALITY.exists():
        heading = "## Simulated clusters (`benchmarks/plan_quality.py`, from `benchmarks/plan_quality.md`)"
        lines += ["", heading, "", PLAN_QUALITY.read_text().strip()]
    return "\n".join(lines) + "\n"


def plot(
    runs: dict[str, list[dict[str, Any]]], plan_files: dict[str, Path], spec: ModelSpec, args: argparse.Namespace
) -> None:
    """One row per plan: the cost model's per-rank load (lookups, intra- and inter-node communication, ms)
    and the measured per-rank bytes per step (intra- and inter-node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planners = args.planners
    cost_model = CostModel(spec, Topology(args.world_size, args.local_world_size, hardware_preset(HARDWARE)))
    costs = {p: cost_model.evaluate(Plan.load(plan_files[p])) for p in planners}
    fig, axes = plt.subplots(len(planners), 2, figsize=(12, 2.8 * len(planners)), squeeze=False)
    ranks = np.arange(args.world_size)
    top_ms = max(float(c.rank_load_ms.max()) for c in costs.values()) * 1.05
    steps = {p: max(runs[p][0]["steps_run"], 1) for p in planners}
    total = {p: np.array(runs[p][0]["comm_bytes_by_rank"]) / steps[p] / 1e6 for p in planners}
    inter = {p: np.array(runs[p][0]["inter_node_bytes_by_rank"]) / steps[p] / 1e6 for p in planners}
    top_mb = max(float(t.max()) for t in total.values()) * 1.05 or 1.0
    for row, p in enumerate(planners):
        c, left, right = costs[p], axes[row, 0], axes[row, 1]
        left.bar(ranks, c.rank_lookup_ms, label="lookup", color="#4c72b0")
        left.bar(ranks, c.rank_intra_ms, bottom=c.rank_lookup_ms, label="intra-node comm", color="#55a868")
        left.bar(
            ranks, c.rank_inter_ms, bottom=c.rank_lookup_ms + c.rank_intra_ms, label="inter-node comm", color="#c44e52"
        )
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
    fig.savefig(args.plot, dpi=100)
    plt.close(fig)


def round_flags(args: argparse.Namespace, timeout_s: float = TIMEOUT_S) -> list[str]:
    """The flags of the runs and rounds (planners, rounds, steps, batch, timeout unless `timeout_s`, pipelining),
    as a command line gives them: this benchmark's and cluster_e2e.py's."""
    flags = [
        f"--planners {','.join(args.planners)}",
        f"--rounds {args.rounds}",
        f"--steps {args.steps}",
        f"--batch-size {args.batch_size}",
    ]
    flags += [f"--timeout-s {args.timeout_s:g}"] if args.timeout_s != timeout_s else []
    return flags + (["--no-pipeline"] if args.no_pipeline else [])


def add_round_arguments(p: argparse.ArgumentParser, batch_size: int, timeout_s: float, timeout_help: str) -> None:
    """The run and round flags this benchmark and cluster_e2e.py share (round_flags writes them back)."""
    p.add_argument(
        "--planners",
        default=",".join(DEFAULT_PLANNERS),
        help=f"comma-separated, of {', '.join(RUNS)}; each round runs them in that order ({NO_UB} needs embark)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=batch_size, help="per rank")
    p.add_argument("--timeout-s", type=float, default=timeout_s, help=timeout_help)


def command(args: argparse.Namespace) -> str:
    """This run's command line, every flag that changes it included (so the markdown can be reproduced)."""
    flags = [f"--model {args.model}"] if args.model else []
    flags += [f"--world-size {args.world_size}", f"--local-world-size {args.local_world_size}", *round_flags(args)]
    flags += ["--calibrate"] if args.calibrate else [f"--hardware {args.hardware}"] if args.hardware else []
    flags += [f"--out {args.out}"] if args.out != OUT else []
    flags += [f"--plot {args.plot}"] if args.plot else []
    return f"PYTHONPATH=. .venv/bin/python benchmarks/e2e.py {' '.join(flags)}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        help="model spec file (JSON/YAML) or built-in name, as train.py's --model; default: train.py's default",
    )
    p.add_argument("--world-size", type=int, default=4, help="ranks (torchrun's --nproc_per_node)")
    p.add_argument("--local-world-size", type=int, default=2, help="ranks per simulated node")
    add_round_arguments(p, batch_size=512, timeout_s=TIMEOUT_S, timeout_help="per run")
    p.add_argument("--no-pipeline", action="store_true", help="run the example without TrainPipelineSparseDist")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--plot", type=Path, help="PNG of per-rank estimated load and measured bytes of each plan")
    hardware = p.add_mutually_exclusive_group()
    hardware.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate with the example's --calibrate first; plan every run so",
    )
    hardware.add_argument("--hardware", type=Path, help="plan every run with this hardware file")
    args = p.parse_args(argv)
    given = args.planners.split(",")
    unknown = sorted(set(given) - set(RUNS))
    if unknown:
        p.error(f"--planners: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if len(set(given)) != len(given):
        p.error(f"--planners: {args.planners} names a planner twice")
    if NO_UB in given and "embark" not in given:
        p.error(f"--planners: {NO_UB} runs embark's plan of the same round, so it needs embark too")
    args.planners = tuple(r for r in RUNS if r in given)
    if args.world_size < 1 or args.local_world_size < 1 or args.world_size % args.local_world_size:
        p.error(f"--local-world-size {args.local_world_size} does not divide --world-size {args.world_size}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    spec = load_spec(args.model, None).with_batch_size(args.batch_size * args.world_size)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.planners}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.calibrate:
            args.hardware = calibrate(args, Path(tmp))
        plan_files = {p: Path(tmp) / f"{p}.json" for p in args.planners}
        no_ub_in = Path(tmp) / f"{NO_UB}-in.json"
        for i in range(args.rounds):
            for p in args.planners if i % 2 == 0 else args.planners[::-1]:  # embark's plan file exists from round 0
                if p == NO_UB:
                    without_ub(plan_files["embark"], no_ub_in)
                result = run_example(p, args, plan_files[p], no_ub_in if p == NO_UB else None)
                result["clusters"] = cluster_counts(plan_files[p])
                runs[p].append(result)
                print(
                    f"round {i + 1}/{args.rounds} {p}: {result['samples_per_s']:,.0f} samples/s, "
                    f"{result['inter_node_bytes_per_step']:,} inter-node bytes/step, AUROC {result['auc']:.4f}, "
                    f"clusters {result['clusters']}",
                    flush=True,
                )
        if args.plot:
            plot(runs, plan_files, spec, args)
    text = markdown(runs, args, spec, time.perf_counter() - start)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
