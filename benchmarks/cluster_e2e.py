"""End to end on an emulated cluster: the DLRM example on CPU ranks in network-namespace nodes joined by
shaped links (python -m embark_torchrec.cluster), for several models and link rates, planned by embark, embark
with fp16 on the wire, TorchRec's default planner and table-row-wise (TWRW), in interleaved rounds.

e2e.py groups ranks into nodes only in the cost model and the byte counters: its ranks all talk over one
loopback. Here cross-node traffic really crosses a link of `--link-mbit` Mbit/s per direction, so a plan that
moves fewer bytes between nodes should be measurably faster, by about what the cost model predicts. Per (model,
link rate): one calibration job of the example on that cluster (its --calibrate), whose hardware file every run
of that pair then plans with (torchrec and trw too: it prices their estimated step), then the planners in
interleaved rounds (every other round in reverse). Runs reuse e2e.py's machinery; each run's RESULT is parsed.

    PYTHONPATH=. .venv/bin/python benchmarks/cluster_e2e.py [--models default,benchmarks/models/dlrm_main.json,...]
        [--nodes 2] [--gpus-per-node 2] [--link-mbit 200,50] [--planners embark,embark-fp16,torchrec,trw]
        [--rounds 3] [--steps 100] [--batch-size 2048] [--out benchmarks/cluster_e2e.md] [--hardware-dir DIR]

The calibrated hardware files and the plans that ran go to --hardware-dir (benchmarks/ by default).

Needs root (network namespaces), ip and tc. The markdown is rewritten after every (model, link rate), so an
interrupted benchmark keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Sequence

from embark_torchrec.cluster import ClusterError, ClusterSpec, preflight
from embark_torchrec.plan.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from e2e import (  # noqa: E402 (e2e.py, next to this file, needs the path above; it puts train.py's on the path)
    NO_UB,
    RUNS,
    add_round_arguments,
    calibrate,
    cluster_counts,
    describe,
    medians,
    ratio,
    round_flags,
    round_ratio,
    run_example,
    without_ub,
)
from train import load_spec  # noqa: E402 (the example's models; e2e.py put its directory on the path)

OUT = ROOT / "benchmarks" / "cluster_e2e.md"
HARDWARE_DIR = ROOT / "benchmarks"
DEFAULT_MODEL = "default"  # --models' name for train.py's default model (no --model flag)
MODELS = (DEFAULT_MODEL, "benchmarks/models/dlrm_main.json", "benchmarks/models/multihot_zipf.json")
MULTIHOT_ZIPF = "multihot_zipf"  # the model the embark-vs-trw target is about (its label: the file's stem)
LINK_MBIT = (200.0, 50.0)
NODES, GPUS_PER_NODE = 2, 2
BATCH_SIZE = 2048  # per rank
TIMEOUT_S = 1200.0  # per run, the cluster's own --timeout-s (calibration at 50 Mbit/s takes minutes)
STOP_S = 120.0  # more for our subprocess timeout, so that the cluster stops its nodes and removes its namespaces
# itself (a subprocess timeout kills it with SIGKILL, which would leave them behind)

INTERRUPTS: list[int] = []  # Ctrl-Cs received (see on_interrupt)

# (a, b): a's speedup over b, measured and predicted
PAIRS = (("embark", "torchrec"), ("embark", "trw"), ("embark-fp16", "torchrec"))
PREDICTION_TARGET = 0.15  # |measured speedup / predicted speedup - 1|
ESTIMATE_TARGET = 0.20  # |estimated step / measured step - 1|, every plan
# (a, b, minimum samples/s ratio, only on this model or None for every model)
SPEEDUP_TARGETS = (
    ("embark", "trw", 1.5, MULTIHOT_ZIPF),
    ("embark", "torchrec", 1.0, None),
    ("embark-fp16", "torchrec", 1.15, None),
)


@dataclass
class Outcome:
    """One (model, link rate): what the rounds measured, and what they ran with."""

    model: str | None
    label: str
    spec: ModelSpec
    link_mbit: float
    hardware: Path
    runs: dict[str, list[dict[str, Any]]]
    seconds: float


@dataclass
class Rounds:
    """Interleaved rounds of several plans (sweep.py, scaling.py): each plan's RESULTs, one a round, and its
    estimated step in ms."""

    runs: dict[str, list[dict[str, Any]]]
    estimated_ms: dict[str, float]

    def measured(self, a: str, b: str) -> float:
        """a's speedup over b: the median over rounds of the per-round samples/s ratios."""
        return round_ratio(self.runs, a, b, "samples_per_s")

    def predicted(self, a: str, b: str) -> float:
        """a's speedup over b by the cost model: b's estimated step over a's."""
        return self.estimated_ms[b] / self.estimated_ms[a]

    def round_steps_ms(self, run: str) -> list[float]:
        """A run's step in each round less the slowest rank's batch making."""
        return [r["step_ms"] - r["data_ms_per_step"] for r in self.runs[run]]

    def measured_ms(self, run: str) -> float:
        """A run's measured step: the median over rounds of round_steps_ms."""
        return float(statistics.median(self.round_steps_ms(run)))

    def estimate_error(self, run: str) -> float:
        """The estimated step over the measured one (measured_ms), less 1."""
        return self.estimated_ms[run] / self.measured_ms(run) - 1


def model_label(model: str | None) -> str:
    """A short name for file names and headings: `default`, a spec file's stem, or a built-in name."""
    if model is None:
        return DEFAULT_MODEL
    return Path(model).stem if Path(model).suffix in (".json", ".yaml", ".yml") else model


def rate_label(link_mbit: float) -> str:
    return f"{link_mbit:g}mbit"


def launcher(args: argparse.Namespace, nodes: int, link_mbit: float) -> list[str]:
    """The command that starts the example's ranks on an emulated cluster of `nodes` x args.gpus_per_node at this
    link rate (e2e.run_example puts the example and its flags after it)."""
    return [
        sys.executable, "-m", "embark_torchrec.cluster", "--nodes", str(nodes),
        "--gpus-per-node", str(args.gpus_per_node), "--link-mbit", f"{link_mbit:g}",
        "--timeout-s", f"{args.timeout_s:g}", "--",
    ]  # fmt: skip


def cluster_run(
    args: argparse.Namespace,
    model: str | None,
    nodes: int,
    link_mbit: float,
    hardware: Path | None,
    out: Path,
    quick_calibration: bool = True,
    no_pipeline: bool = False,
) -> argparse.Namespace:
    """What e2e.run_example and e2e.calibrate read for one job of the example on an emulated cluster (this script's,
    sweep.py's and scaling.py's); `out` only names the hardware file e2e.calibrate keeps (its .hardware.json)."""
    return argparse.Namespace(
        model=model,
        world_size=nodes * args.gpus_per_node,
        local_world_size=args.gpus_per_node,
        steps=args.steps,
        batch_size=args.batch_size,
        no_pipeline=no_pipeline,
        timeout_s=args.timeout_s + STOP_S,
        hardware=hardware,
        launcher=launcher(args, nodes, link_mbit),
        quick_calibration=quick_calibration,
        out=out,
    )


def run_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The example's flags for every run of sweep.py and scaling.py: their warm-up, and one held-out batch (they read
    no AUROC, and 20 batches of evaluation over a slow link took a tenth of each run)."""
    return ("--warmup-steps", str(args.warmup_steps), "--eval-batches", "1")


def run_args(
    args: argparse.Namespace, model: str | None, link_mbit: float, hardware: Path | None
) -> argparse.Namespace:
    """One (model, link rate)'s job; its calibration is kept as
    <hardware-dir>/cluster_e2e_<model>_<rate>mbit.hardware.json."""
    out = args.hardware_dir / f"cluster_e2e_{model_label(model)}_{rate_label(link_mbit)}.md"
    return cluster_run(args, model, args.nodes, link_mbit, hardware, out, args.quick_calibration, args.no_pipeline)


def measure(args: argparse.Namespace, model: str | None, spec: ModelSpec, link_mbit: float) -> Outcome:
    """Calibrate on the cluster at this rate, then the planners' interleaved rounds planned with that file."""
    label, start = model_label(model), time.perf_counter()
    where = f"{label} @ {link_mbit:g} Mbit/s"
    print(f"{where}: calibrating on the cluster", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        stop_if_interrupted()
        hardware = calibrate(run_args(args, model, link_mbit, None), Path(tmp))
        print(f"{where}: hardware file {hardware} ({inter_node_mbit(hardware):,.0f} Mbit/s inter-node)", flush=True)
        once = run_args(args, model, link_mbit, hardware)
        # kept next to the hardware file, so that each plan can be priced again (and read) after the run
        plan_files = {
            p: args.hardware_dir / f"cluster_e2e_{label}_{rate_label(link_mbit)}_{p}.plan.json" for p in args.planners
        }
        no_ub_in = Path(tmp) / f"{NO_UB}-in.json"
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.planners}
        for i in range(args.rounds):
            for p in args.planners if i % 2 == 0 else args.planners[::-1]:  # embark's plan file exists from round 0
                if p == NO_UB:
                    without_ub(plan_files["embark"], no_ub_in)
                stop_if_interrupted()
                result = run_example(p, once, plan_files[p], no_ub_in if p == NO_UB else None)
                result["clusters"] = cluster_counts(plan_files[p])
                result["measured_step_ms"] = result["step_ms"] - result["data_ms_per_step"]
                runs[p].append(result)
                print(
                    f"{where} round {i + 1}/{args.rounds} {p}: {result['samples_per_s']:,.0f} samples/s, "
                    f"{result['inter_node_bytes_per_step']:,} inter-node bytes/step, step "
                    f"{result['estimated_step_ms']:.1f} ms estimated / {result['measured_step_ms']:.1f} ms measured, "
                    f"clusters {result['clusters']}",
                    flush=True,
                )
    return Outcome(model, label, spec, link_mbit, hardware, runs, time.perf_counter() - start)


def inter_node_mbit(hardware: Path) -> float:
    """The calibrated inter-node bandwidth (GB/s in the file) in Mbit/s, to set against the link's rate."""
    return float(json.loads(hardware.read_text())["hardware"]["inter_node_bw_gbps"]) * 8e3


def speedups(o: Outcome, a: str, b: str) -> tuple[float, float, float]:
    """a's speedup over b: measured samples/s and measured step less data (medians of per-round ratios), and
    predicted (b's estimated step / a's, medians over rounds; the estimate is the same every round)."""
    est = medians(o.runs, "estimated_step_ms")
    return (
        round_ratio(o.runs, a, b, "samples_per_s"),
        round_ratio(o.runs, b, a, "measured_step_ms"),
        est[b] / est[a],
    )


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def section(o: Outcome, args: argparse.Namespace) -> list[str]:
    """One (model, link rate): the plans' table, the speedups against the cost model's prediction, the targets."""
    planners = [p for p in args.planners if o.runs[p]]
    rate = medians(o.runs, "samples_per_s")
    inter = medians(o.runs, "inter_node_bytes_per_step")
    total = medians(o.runs, "comm_bytes_per_step")
    est = medians(o.runs, "estimated_step_ms")
    measured = medians(o.runs, "measured_step_ms")
    data = medians(o.runs, "data_ms_per_step")
    lines = [
        f"## {o.label} at {o.link_mbit:g} Mbit/s",
        "",
        f"{describe(o.spec, o.model)}. Planned with `{display(o.hardware)}`, calibrated on this cluster before the "
        f"rounds (inter-node bandwidth {inter_node_mbit(o.hardware):,.0f} Mbit/s per rank; the link carries "
        f"{o.link_mbit:g} Mbit/s per direction for the node's {args.gpus_per_node} ranks); {o.seconds / 60:.1f} min.",
        "",
        "| plan | clusters | samples/s | samples/s per round | inter-node bytes / step | bytes / step "
        "| data ms / step | estimated step ms | measured step ms | estimated / measured |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in planners:
        clusters = " / ".join(dict.fromkeys(", ".join(f"{c} {n}" for c, n in r["clusters"].items()) for r in o.runs[p]))
        per_round = ", ".join(f"{r['samples_per_s']:,.0f}" for r in o.runs[p])
        lines.append(
            f"| {p} | {clusters} | {rate[p]:,.0f} | {per_round} | {inter[p]:,.0f} | {total[p]:,.0f} | {data[p]:.1f} "
            f"| {est[p]:.1f} | {measured[p]:.1f} | {ratio(est[p], measured[p])} |"
        )
    pairs = [(a, b) for a, b in PAIRS if a in planners and b in planners]
    if pairs:
        lines += [
            "",
            "| speedup | measured, samples/s | measured, step less data | predicted (estimated steps) "
            f"| measured samples/s / predicted | within {PREDICTION_TARGET:.0%} |",
            "|---|---:|---:|---:|---:|---|",
        ]
    for a, b in pairs:
        by_rate, by_step, predicted = speedups(o, a, b)
        off = by_rate / predicted - 1
        lines.append(
            f"| {a} / {b} | {by_rate:.2f}x | {by_step:.2f}x | {predicted:.2f}x | {by_rate / predicted:.2f} "
            f"| {'yes' if abs(off) <= PREDICTION_TARGET else '**no**'} ({off:+.0%}) |"
        )
    lines += ["", *(f"- {t}" for t in targets(o))]
    return lines


def targets(o: Outcome) -> list[str]:
    """This (model, rate)'s targets, each with its value and whether it is met."""
    out = []
    for a, b, floor, only in SPEEDUP_TARGETS:
        if (only is None or o.label == only) and o.runs.get(a) and o.runs.get(b):
            got = round_ratio(o.runs, a, b, "samples_per_s")
            out.append(
                f"Target {a} >= {floor:g}x {b} (samples/s, median of per-round ratios): {got:.2f}x, "
                f"{verdict(got >= floor)}."
            )
    est, measured = medians(o.runs, "estimated_step_ms"), medians(o.runs, "measured_step_ms")
    offs = {p: est[p] / measured[p] - 1 for p in o.runs if o.runs[p]}
    worst = max(offs, key=lambda p: abs(offs[p]))
    within = all(abs(v) <= ESTIMATE_TARGET for v in offs.values())
    out.append(
        f"Target every plan's estimated step within {ESTIMATE_TARGET:.0%} of its measured step: "
        + ", ".join(f"{p} {v:+.0%}" for p, v in offs.items())
        + f" (worst {worst}), {verdict(within)}."
    )
    return out


def summary(outcomes: list[Outcome], args: argparse.Namespace) -> list[str]:
    """Every target over every (model, link rate) done: met where it is met in each."""
    lines = []
    for a, b, floor, only in SPEEDUP_TARGETS:
        got = [
            (o, round_ratio(o.runs, a, b, "samples_per_s"))
            for o in outcomes
            if (only is None or o.label == only) and o.runs.get(a) and o.runs.get(b)
        ]
        if got:
            where = f"on {only}" if only else "on every model"
            values = ", ".join(f"{o.label} @ {o.link_mbit:g} Mbit/s {v:.2f}x" for o, v in got)
            lines.append(f"- {a} >= {floor:g}x {b} {where}: {values}; {verdict(all(v >= floor for _, v in got))}.")
    offs = []
    for o in outcomes:
        est, measured = medians(o.runs, "estimated_step_ms"), medians(o.runs, "measured_step_ms")
        offs += [abs(est[p] / measured[p] - 1) for p in o.runs if o.runs[p]]
    if offs:
        lines.append(
            f"- every plan's estimated step within {ESTIMATE_TARGET:.0%} of its measured step: worst "
            f"{max(offs):.0%} off; {verdict(max(offs) <= ESTIMATE_TARGET)}."
        )
    return lines


def markdown(outcomes: list[Outcome], args: argparse.Namespace, seconds: float, planned: int) -> str:
    """The setup, the targets over all pairs done, one section per (model, link rate), the command."""
    rates = " and ".join(f"{r:g}" for r in args.link_mbit)
    ws = args.nodes * args.gpus_per_node
    done = "" if len(outcomes) == planned else f" (partial: {len(outcomes)} of {planned} model and link pairs done)"
    lines = [
        f"# End to end on an emulated cluster: the DLRM example on {args.nodes} nodes x {args.gpus_per_node} CPU "
        f"ranks (gloo), linked at {rates} Mbit/s",
        "",
        f"Each node is a network namespace (`python -m embark_torchrec.cluster`): its {args.gpus_per_node} ranks talk "
        "over its own loopback (unshaped), and reach the other nodes only through one veth link shaped by tc's tbf "
        "to the given rate in each direction; one torchrun agent per node. All "
        f"{ws} ranks share this box's CPU cores. Synthetic data, batch {args.batch_size} per rank, {args.steps} steps "
        f"per run, {args.rounds} interleaved round{'s' if args.rounds > 1 else ''} of {', '.join(args.planners)} "
        "(every other round in reverse), "
        f"{'without pipelining' if args.no_pipeline else 'TrainPipelineSparseDist'}; per (model, link rate) the "
        "example's --calibrate ran first on that cluster and every run planned with its hardware file. samples/s: "
        "median over rounds (warm-up steps and the last step, which distributes no next batch, left out); bytes: "
        "per step, the maximum over ranks of what a rank sent + "
        "received in embedding collectives (DDP's all-reduce not counted); measured step ms: median over rounds of "
        "the step less the time the slowest rank spent making a batch (no plan changes it), against the cost "
        "model's estimated step for the plan that ran. Speedups: measured, the median of per-round ratios (runs of "
        "a round share the machine's load); predicted, the baseline's estimated step / the other plan's. "
        f"{seconds / 60:.1f} min in all{done}.",
        "",
        "## Targets",
        "",
        *summary(outcomes, args),
    ]
    for o in outcomes:
        lines += ["", *section(o, args)]
    lines += ["", f"Reproduce: `{command(args)}`"]
    return "\n".join(lines) + "\n"


def with_figures_of(base: Path, source: Path, fields: Sequence[str]) -> dict[str, Any]:
    """`base`'s hardware document with `fields` taken from `source`'s (each figure, and its source and measurement
    where `source` records them): a cluster's calibration with figures measured or fitted elsewhere on it."""
    document, other = json.loads(base.read_text()), json.loads(source.read_text())
    for field in fields:
        document["hardware"][field] = other["hardware"][field]
        for part in ("sources", "measurements"):
            if field in other.get(part, {}):
                document.setdefault(part, {})[field] = other[part][field]
    return document


def display(path: Path) -> str:
    """A path relative to the repository where it lies inside it (the markdown should not name this box's paths)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def command(args: argparse.Namespace) -> str:
    """This benchmark's command line, every flag that changes it included."""
    flags = [] if args.models == list(MODELS) else [f"--models {','.join(args.models)}"]
    flags += [
        f"--nodes {args.nodes}",
        f"--gpus-per-node {args.gpus_per_node}",
        f"--link-mbit {','.join(f'{r:g}' for r in args.link_mbit)}",
        *round_flags(args, TIMEOUT_S),
    ]
    flags += [f"--out {display(args.out)}"] if args.out.resolve() != OUT else []
    flags += [f"--hardware-dir {display(args.hardware_dir)}"] if args.hardware_dir.resolve() != HARDWARE_DIR else []
    flags += ["--quick-calibration"] if args.quick_calibration else []
    return f"PYTHONPATH=. .venv/bin/python benchmarks/cluster_e2e.py {' '.join(flags)}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated spec files (JSON/YAML) or built-in names, as train.py's --model; "
        f"'{DEFAULT_MODEL}': train.py's default model",
    )
    p.add_argument("--nodes", type=int, default=NODES, help="emulated nodes")
    p.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE, help="ranks per node")
    p.add_argument(
        "--link-mbit",
        default=",".join(f"{r:g}" for r in LINK_MBIT),
        help="comma-separated rates of each node's link, Mbit/s per direction",
    )
    add_round_arguments(p, batch_size=BATCH_SIZE, timeout_s=TIMEOUT_S, timeout_help="per run (the calibration job too)")
    p.add_argument("--no-pipeline", action="store_true", help="run the example without TrainPipelineSparseDist")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--hardware-dir", type=Path, default=HARDWARE_DIR, help="where the calibrated hardware files go")
    p.add_argument(
        "--quick-calibration",
        action="store_true",
        help="calibrate with the example's --calibrate quick (fewer repeats: minutes less on slow links)",
    )
    args = p.parse_args(argv)
    args.hardware_dir = args.hardware_dir.resolve()  # the runs' working directory is the repository's
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models:
        p.error("--models: give at least one model")
    try:
        args.link_mbit = [float(r) for r in args.link_mbit.split(",") if r.strip()]
        for rate in args.link_mbit:
            ClusterSpec(nodes=args.nodes, gpus_per_node=args.gpus_per_node, link_mbit=rate)
    except ValueError as e:
        p.error(f"--link-mbit / --nodes / --gpus-per-node: {e}")
    if not args.link_mbit:
        p.error("--link-mbit: give at least one rate")
    given = [g.strip() for g in args.planners.split(",")]
    unknown = sorted(set(given) - set(RUNS))
    if unknown:
        p.error(f"--planners: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if NO_UB in given and "embark" not in given:
        p.error(f"--planners: {NO_UB} runs embark's plan of the same round, so it needs embark too")
    args.planners = tuple(r for r in RUNS if r in given)
    if args.rounds < 1 or args.steps < 2 or args.batch_size < 1:
        p.error("--rounds, --batch-size must be >= 1 and --steps >= 2")
    return args


def on_interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C reaches the running cluster too (our process group), which stops its nodes and removes its
    namespaces; raising here as well would make e2e.run_example's subprocess.run SIGKILL it mid-teardown, leaving
    namespaces and torchrun agents (in their own sessions) behind. So only note it: the run fails, and we stop."""
    INTERRUPTS.append(signum)


def cluster_ready(script: str) -> bool:
    """Whether this box can emulate a cluster (else why not, as `script`'s error), checked before the first run; then
    Ctrl-C goes to on_interrupt, so that a run's cluster removes its namespaces before the benchmark stops."""
    try:
        preflight()
    except ClusterError as e:
        print(f"{script}: {e}", file=sys.stderr)
        return False
    signal.signal(signal.SIGINT, on_interrupt)
    return True


def stop_if_interrupted() -> None:
    if INTERRUPTS:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not cluster_ready("cluster_e2e.py"):
        return 2
    models = [None if m == DEFAULT_MODEL else m for m in args.models]
    ws = args.nodes * args.gpus_per_node
    specs = [load_spec(m, None).with_batch_size(args.batch_size * ws) for m in models]  # a bad model fails here
    args.hardware_dir.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    planned, start = len(models) * len(args.link_mbit), time.perf_counter()
    try:
        for model, spec in zip(models, specs):
            for link_mbit in args.link_mbit:
                outcomes.append(measure(args, model, spec, link_mbit))
                args.out.write_text(markdown(outcomes, args, time.perf_counter() - start, planned))
    except (KeyboardInterrupt, RuntimeError):
        if not INTERRUPTS:
            raise
        kept = f"; {args.out} holds the {len(outcomes)} model and link pairs done" if outcomes else ""
        print(f"cluster_e2e.py: interrupted{kept}", file=sys.stderr)
        return 130
    text = markdown(outcomes, args, time.perf_counter() - start, planned)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
