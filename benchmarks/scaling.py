"""The scaling curve: weak scaling (a fixed batch per rank) of embark, TorchRec's default planner and table-row-wise
(TWRW) on emulated clusters of 1, 2, 4 (and 8) nodes joined by links of one fixed rate per node, for two models
(dlrm_main-like and multi-hot), with the cost model's prediction beside every point.

EMBark's claim is about growth: as nodes are added, more of each rank's embedding traffic crosses the slow links,
so a plan that keeps traffic inside nodes (or sends less of it) should pull further ahead of TWRW. Each cluster
size is calibrated once (the example's --calibrate, quick; --hardware-dir keeps the files, and reuses one that is
there), then each model's dense part is measured on it (--calibrate dense: seconds) and the planners run in
interleaved rounds. Reported per (model, nodes): samples/s per plan, embark's measured and predicted speedup over
TorchRec's and TWRW's plans, and the share of TorchRec's and TWRW's measured step their embedding bytes take on the
link (the inter-node bytes a rank counted per step, times the node's ranks, at the link's rate per direction: the
time the link needs at least, against the step). A PNG plots samples/s and embark's lead against nodes.

On this 2-core box every rank of every node shares the same cores, so compute per rank shrinks as ranks are added;
the link rate is set low (--link-mbit, 50 by default) to keep communication the larger part of the step, and the
calibration at each size measures the shared cores' figures, so the prediction prices what the box does. With
--dilate-links the sizes emulate one cluster in slow motion: --link-mbit is a node's link when each rank has a core,
and a size whose ranks share the cores gets its link slowed as much as their compute (docs/results.md, "Links slowed
as the ranks share the cores").

    PYTHONPATH=. .venv/bin/python benchmarks/scaling.py [--nodes 1,2,4] [--gpus-per-node 1] [--link-mbit 50]
        [--dilate-links] [--single-node-steps 100]
        [--models benchmarks/models/dlrm_main.json,benchmarks/models/multihot_zipf.json] [--rounds 2] [--steps 25]
        [--warmup-steps 4] [--batch-size 1024] [--out benchmarks/scaling.md] [--hardware-dir benchmarks/scaling]
        [--link-ratios benchmarks/sweep4_50mbit.hardware.json | --link-ratios 2=FILE,4=FILE]

The paired ratio (how fast a rank's bytes cross nodes in pairs, as TWRW's do) is not one figure for every size: on
this box's links the steps fit 0.82 at 2 nodes and 1.10 at 4. So each size's may be fitted to a first run's points
at that size (benchmarks/fit_link_ratios.py --points, the one-way ratio held at the sweeps'), and the curve planned
with them, NODES=FILE per size.

Each point's files (its hardware file with the dense part, its plans, its rounds) are kept in
benchmarks/scaling/<model>_<nodes>x<ranks per node>/.

Needs root (network namespaces), ip and tc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embark_torchrec.cluster import ClusterSpec
from embark_torchrec.plan import CostModel, Plan, Topology
from embark_torchrec.plan.model.hardware_file import load_hardware, save_hardware

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster_e2e import (  # noqa: E402 (next to this file)
    INTERRUPTS,
    TIMEOUT_S,
    Rounds,
    cluster_ready,
    cluster_run,
    display,
    run_flags,
    stop_if_interrupted,
    with_figures_of,
)
from e2e import calibrate, calibrate_dense, run_example  # noqa: E402
from fit_link_ratios import FIELDS as FITTED_LINK_FIGURES  # noqa: E402
from train import load_spec  # noqa: E402 (the example's models; e2e.py put its directory on the path)

OUT = ROOT / "benchmarks" / "scaling.md"
CORES = len(os.sched_getaffinity(0))  # the cores every emulated node's ranks share
HARDWARE_DIR = ROOT / "benchmarks" / "scaling"
MODELS = ("benchmarks/models/dlrm_main.json", "benchmarks/models/multihot_zipf.json")
PLANNERS = ("embark", "torchrec", "trw")
TRW_LEAD = 1.5  # embark / trw at 4 nodes
TORCHREC_LEAD = 1.1  # embark / torchrec at 4 nodes
PREDICTION_TARGET = 0.15  # |measured / predicted speedup - 1|
# what --link-ratios takes from its file: the figures fit_link_ratios.py fits, and the phase overlap it fits at
LINK_RATIOS = (*FITTED_LINK_FIGURES, "inter_node_phase_overlap")


@dataclass
class Point(Rounds):
    """One (model, nodes): its rounds, every plan priced with that size's hardware file, and the link shares."""

    model: str
    nodes: int
    link_share: dict[str, float]

    def samples_per_s(self, planner: str) -> float:
        return float(statistics.median(r["samples_per_s"] for r in self.runs[planner]))


def at_size(args: argparse.Namespace, nodes: int) -> argparse.Namespace:
    """The settings a run at this size takes: --single-node-steps on one node, else --steps."""
    return argparse.Namespace(**{**vars(args), "steps": args.single_node_steps if nodes == 1 else args.steps})


def link_mbit(args: argparse.Namespace, nodes: int) -> float:
    """The link of each node at this size, Mbit/s per direction: --link-mbit, or with --dilate-links that rate slowed
    as much as the ranks' compute is by sharing the box's cores, so that compute and communication keep the
    proportions of the cluster emulated (ranks with a core each) at every size."""
    ranks = nodes * args.gpus_per_node
    return args.link_mbit * min(1.0, CORES / ranks) if args.dilate_links else args.link_mbit


def link_text(args: argparse.Namespace) -> str:
    """The markdown's words for the links."""
    if not args.dilate_links:
        return f"{args.link_mbit:g} Mbit/s per node's link"
    return f"{args.link_mbit:g} Mbit/s per node's link with a core per rank, slowed as the ranks share {CORES} cores"


def hardware_file(args: argparse.Namespace, nodes: int, tmp: Path) -> Path:
    """This size's calibrated hardware file: the one kept in --hardware-dir, else one calibration of the first model."""
    kept = args.hardware_dir / f"scaling_{nodes}x{args.gpus_per_node}_{link_mbit(args, nodes):g}mbit.hardware.json"
    if kept.exists():
        load_hardware(kept)  # a bad file fails here, before the runs
        return kept
    print(f"{nodes} nodes: calibrating (quick)", flush=True)
    out = kept.with_suffix("").with_suffix(".md")
    return calibrate(cluster_run(at_size(args, nodes), args.models[0], nodes, link_mbit(args, nodes), None, out), tmp)


def link_share(result: dict[str, Any], args: argparse.Namespace, nodes: int) -> float:
    """The least time the link needs for a step's embedding bytes, over the measured step: a rank's counted inter-node
    bytes (sent + received) times the node's ranks, half each way, at the link's rate per direction."""
    per_direction = result["inter_node_bytes_per_step"] * args.gpus_per_node / 2
    link_ms = per_direction * 8 / (link_mbit(args, nodes) * 1e6) * 1e3
    return link_ms / result["step_ms"]


def measure(args: argparse.Namespace, model: str, nodes: int, cluster: Path, tmp: Path) -> Point:
    """One (model, nodes): the cluster's file with this model's dense part measured on it first (the example's
    --calibrate dense), then the planners' interleaved rounds planned and priced with it."""
    ws = nodes * args.gpus_per_node
    name = f"{Path(model).stem}_{nodes}"
    folder = point_folder(args, model, nodes)
    folder.mkdir(parents=True, exist_ok=True)
    dense_run = cluster_run(at_size(args, nodes), model, nodes, link_mbit(args, nodes), cluster, tmp / "unused.md")
    hardware = folder / "hardware.json"
    calibrated = calibrate_dense(dense_run, tmp, f"{name}_dense")
    save_hardware(hardware, with_link_ratios(calibrated, ratios_for(args, nodes)))
    plans = {p: folder / f"{p}.plan.json" for p in PLANNERS}
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PLANNERS}
    for i in range(args.rounds):
        for p in PLANNERS if i % 2 == 0 else PLANNERS[::-1]:
            stop_if_interrupted()
            once = cluster_run(at_size(args, nodes), model, nodes, link_mbit(args, nodes), hardware, tmp / "unused.md")
            result = run_example(p, once, plans[p], extra=run_flags(args))
            runs[p].append(result)
            print(f"{Path(model).stem} @ {nodes} nodes round {i + 1} {p}: {result['samples_per_s']:,.0f} samples/s")
    (folder / "rounds.json").write_text(json.dumps({"model": model, "nodes": nodes, "runs": runs}, indent=1))
    spec = load_spec(model, None).with_batch_size(args.batch_size * ws)
    cost = CostModel(spec, Topology(ws, args.gpus_per_node, load_hardware(hardware)))
    estimated = {p: cost.evaluate(Plan.load(plans[p])).step_ms for p in PLANNERS}
    shares = {p: statistics.median(link_share(r, args, nodes) for r in runs[p]) for p in PLANNERS} if nodes > 1 else {}
    return Point(runs, estimated, Path(model).stem, nodes, shares)


def with_link_ratios(calibrated: Path, ratios: Path | None) -> dict[str, Any]:
    """A calibrated hardware document with the link ratios and phase overlap (and their sources and measurements) of
    `ratios`, a file of benchmarks/fit_link_ratios.py's, where one is given: fitted to training steps on the same
    links."""
    return json.loads(calibrated.read_text()) if ratios is None else with_figures_of(calibrated, ratios, LINK_RATIOS)


def point_folder(args: argparse.Namespace, model: str, nodes: int) -> Path:
    """Where a point's files are kept (its model's hardware file with the dense part, its plans, its rounds):
    benchmarks/scaling/dlrm_main_4x2/ for benchmarks/scaling.md."""
    return args.out.with_suffix("") / f"{Path(model).stem}_{nodes}x{args.gpus_per_node}"


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def targets(points: list[Point]) -> list[str]:
    lines = []
    for model in dict.fromkeys(p.model for p in points):
        by_nodes = {p.nodes: p for p in points if p.model == model}
        if 4 in by_nodes:
            four = by_nodes[4]
            lines.append(
                f"- {model} at 4 nodes: embark / trw {four.measured('embark', 'trw'):.2f}x (>= {TRW_LEAD}x "
                f"{verdict(four.measured('embark', 'trw') >= TRW_LEAD)}), embark / torchrec "
                f"{four.measured('embark', 'torchrec'):.2f}x (>= {TORCHREC_LEAD}x "
                f"{verdict(four.measured('embark', 'torchrec') >= TORCHREC_LEAD)})"
            )
            if 2 in by_nodes:
                two, at_four = by_nodes[2].measured("embark", "trw"), four.measured("embark", "trw")
                lines.append(
                    f"- {model}: lead over trw at 4 nodes >= at 2 ({two:.2f}x -> {at_four:.2f}x): "
                    f"{verdict(at_four >= two)}"
                )
        shares = [by_nodes[n].link_share["trw"] for n in sorted(by_nodes) if by_nodes[n].link_share]
        if len(shares) > 1:
            grows = all(a <= b for a, b in zip(shares, shares[1:]))
            shown = " -> ".join(f"{x:.0%}" for x in shares)
            lines.append(f"- {model}: trw's link share grows with nodes ({shown}): {verdict(grows)}")
    offs = [abs(p.measured("embark", b) / p.predicted("embark", b) - 1) for p in points for b in ("torchrec", "trw")]
    lines.append(
        f"- every point's predicted speedup within {PREDICTION_TARGET:.0%} of measured: worst {max(offs):.0%} "
        f"{verdict(max(offs) <= PREDICTION_TARGET)}"
    )
    return lines


def link_ratios_text(args: argparse.Namespace) -> str:
    """Where the markdown's points took their link ratios from."""
    files = args.link_ratios
    if not files:
        return ". "
    if list(files) == [None]:
        return (
            f"; the link ratios (paired, one-way, solo) and the phase overlap from `{display(files[None])}` (fitted to "
            "training steps on these links) at every size. "
        )
    sizes = ", ".join(f"{n} nodes `{display(f)}`" for n, f in sorted(files.items(), key=lambda i: i[0] or 0))
    return (
        f"; the link ratios (paired, one-way, solo) and the phase overlap of each size fitted to training steps at "
        f"that size (benchmarks/fit_link_ratios.py --points): {sizes}; other sizes as calibrated. "
    )


def markdown(points: list[Point], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        f"# Weak scaling on emulated clusters: {args.gpus_per_node} CPU rank(s) per node, {link_text(args)}",
        "",
        f"Batch {args.batch_size} per rank at every size, {args.steps} steps a run, {args.single_node_steps} on one "
        f"node ({args.warmup_steps} of warm-up and "
        f"the pipeline's last step left out of samples/s), {args.rounds} interleaved rounds of {', '.join(PLANNERS)}; "
        f"each size calibrated once (hardware files in `{display(args.hardware_dir)}`), each model's dense part "
        "measured on it before its rounds"
        + link_ratios_text(args)
        + "Speedups: measured, medians of per-round samples/s ratios; predicted, estimated steps' ratio. Link share: "
        "a rank's embedding bytes on the link at its rate, over the measured step (see the script). "
        f"{seconds / 60:.1f} min in all.",
        "",
        "## Targets",
        "",
        *targets(points),
        "",
        "| model | nodes | link Mbit/s | samples/s embark / torchrec / trw | embark / torchrec measured (predicted) "
        "| embark / trw measured (predicted) | link share torchrec / trw | estimated / measured step "
        f"{', '.join(PLANNERS)} |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for p in points:
        rates = " / ".join(f"{p.samples_per_s(x):,.0f}" for x in PLANNERS)
        share = " / ".join(f"{p.link_share[x]:.0%}" for x in ("torchrec", "trw")) if p.link_share else "no link"
        link = f"{link_mbit(args, p.nodes):g}" if p.nodes > 1 else "none"
        lines.append(
            f"| {p.model} | {p.nodes} | {link} | {rates} | {p.measured('embark', 'torchrec'):.2f}x "
            f"({p.predicted('embark', 'torchrec'):.2f}x) | {p.measured('embark', 'trw'):.2f}x "
            f"({p.predicted('embark', 'trw'):.2f}x) | {share} | "
            f"{', '.join(f'{p.estimate_error(x):+.0%}' for x in PLANNERS)} |"
        )
    lines += ["", f"![samples/s and embark's lead against nodes]({args.out.with_suffix('.png').name})"]
    return "\n".join(lines) + "\n"


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, lead_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for model in dict.fromkeys(p.model for p in points):
        mine = sorted((p for p in points if p.model == model), key=lambda p: p.nodes)
        nodes = [p.nodes for p in mine]
        for planner in PLANNERS:
            rate_ax.plot(nodes, [p.samples_per_s(planner) for p in mine], marker="o", label=f"{model} {planner}")
        for b in ("torchrec", "trw"):
            lead_ax.plot(nodes, [p.measured("embark", b) for p in mine], marker="o", label=f"{model} / {b}")
            lead_ax.plot(nodes, [p.predicted("embark", b) for p in mine], ls="--", label=f"{model} / {b} predicted")
    rate_ax.set(xlabel="nodes", ylabel="samples/s", title="weak scaling")
    lead_ax.set(xlabel="nodes", ylabel="embark's speedup", title="embark's lead (dashed: predicted)")
    for ax in (rate_ax, lead_ax):
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="1,2,4", help="comma-separated cluster sizes")
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--link-mbit", type=float, default=50.0, help="each node's link, Mbit/s per direction")
    p.add_argument(
        "--dilate-links",
        action="store_true",
        help="weak scaling in slow motion: --link-mbit is the link of ranks with a core each; a size whose ranks share "
        "this box's cores (compute per rank cores/ranks as fast) gets its link slowed as much, --link-mbit x "
        "min(1, cores/ranks)",
    )
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated spec files or built-in names")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument(
        "--single-node-steps",
        type=int,
        default=100,
        help="steps a run of one node: its steps take milliseconds, so --steps of them time too short a stretch",
    )
    p.add_argument("--warmup-steps", type=int, default=4, help="first steps of a run left out of samples/s")
    p.add_argument("--batch-size", type=int, default=1024, help="per rank, at every size")
    p.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help="per run (the calibration job too)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--hardware-dir", type=Path, default=HARDWARE_DIR, help="where each size's hardware file is kept")
    p.add_argument(
        "--link-ratios",
        default="",
        help="a hardware file whose paired and one-way ratios and phase overlap (benchmarks/fit_link_ratios.py's, "
        "fitted to training steps on these links) replace the ones calibrated at every size; or one per size, "
        "NODES=FILE,... (fit_link_ratios.py --points: each fitted to one size's steps; a size without one keeps its "
        "calibrated figures)",
    )
    args = p.parse_args(argv)
    try:
        args.nodes = sorted({int(n) for n in args.nodes.split(",") if n.strip()})
        for n in args.nodes:
            ClusterSpec(nodes=n, gpus_per_node=args.gpus_per_node, link_mbit=link_mbit(args, n))
    except ValueError as e:
        p.error(f"--nodes / --gpus-per-node / --link-mbit: {e}")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for model in args.models:
        load_spec(model, None)  # a bad model fails here, before any run
    if (
        not args.nodes
        or not args.models
        or args.rounds < 1
        or min(args.steps, args.single_node_steps) < 2
        or args.batch_size < 1
    ):
        p.error("give nodes and models; --rounds, --batch-size >= 1, --steps >= 2")
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    args.hardware_dir = args.hardware_dir.resolve()
    try:
        args.link_ratios = link_ratio_files(args.link_ratios)
    except ValueError as e:
        p.error(f"--link-ratios {args.link_ratios}: {e}")
    for file in args.link_ratios.values():
        load_hardware(file)  # a bad file fails here, before any run
    return args


def link_ratio_files(text: str) -> dict[int | None, Path]:
    """--link-ratios: FILE (key None: every size) or NODES=FILE,... (per size)."""
    if not text.strip():
        return {}
    if "=" not in text:
        return {None: Path(text.strip())}
    out: dict[int | None, Path] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        nodes, sep, file = item.partition("=")
        if not sep or not nodes.strip().isdigit() or not file.strip():
            raise ValueError(f"{item!r}: expected NODES=FILE")
        out[int(nodes)] = Path(file.strip())
    return out


def ratios_for(args: argparse.Namespace, nodes: int) -> Path | None:
    """The file whose link ratios price `nodes` nodes (its own, else the one for every size), or None."""
    return args.link_ratios.get(nodes, args.link_ratios.get(None))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not cluster_ready("scaling.py"):
        return 2
    args.hardware_dir.mkdir(parents=True, exist_ok=True)
    start, points = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            for nodes in args.nodes:
                hardware = hardware_file(args, nodes, tmp)
                for model in args.models:
                    points.append(measure(args, model, nodes, hardware, tmp))
                    args.out.write_text(markdown(points, args, time.perf_counter() - start))
        except (KeyboardInterrupt, RuntimeError):
            if not INTERRUPTS:
                raise
            print(f"scaling.py: interrupted; {args.out} holds the {len(points)} points done", file=sys.stderr)
            return 130
    text = markdown(points, args, time.perf_counter() - start)
    args.out.write_text(text)
    plot(points, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
