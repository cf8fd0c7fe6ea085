"""The network's link ratios fitted to real training steps: Hardware.inter_node_paired_ratio (the rate at which
the hierarchical stage 2 and TorchRec's table-row-wise cross nodes, each rank with its local rank's peer on every
other node, over the all-ranks rate) and Hardware.inter_node_one_way_ratio (how much faster a rank's bytes go where
its traffic in a phase of the step runs one way), and with --fit-solo Hardware.inter_node_solo_ratio, as the kept
sweeps' steps show them.

Calibrate measures both with bare all-to-alls, sample by sample against the all-ranks pattern; on this box's gloo
links their samples spread too far to price a plan by (24 samples: paired p25-p75 0.67-1.18, median 0.97; one way
1.14-1.46), while every table-row-wise plan of sweep 3 ran 3-18% slower than a paired ratio of 0.97 prices it, more
the more of its bytes cross in pairs. So the two figures are read off the steps themselves: every plan the sweeps ran
(embark's, TorchRec's and table-row-wise, each priced with its model's own hardware file) is priced again at each
point of a grid of the two, and the pair with the least squared log error of estimated over measured steps is kept.
The other figures are the cluster's as calibrated; only these two are fitted, and they are written into a copy of
--hardware with the fit's residuals as their measurement and, as its error on plan differences (plan_error_below,
plan_error_above), the band of embark's measured over predicted speedup over TorchRec's plan they leave where the
two plans differ (in sample: the error the planner is told), with the phase overlap
they were fitted at
(Hardware.inter_node_phase_overlap, --phase-overlap: 0 on the emulated cluster, where a table holder's forward sends
and backward receives ran one after the other).

    PYTHONPATH=. .venv/bin/python benchmarks/fit_link_ratios.py --sweeps benchmarks/sweep.md
        --hardware benchmarks/sweep3_50mbit.hardware.json --out benchmarks/sweep4_50mbit.hardware.json
        [--phase-overlap 0]
    PYTHONPATH=. .venv/bin/python benchmarks/fit_link_ratios.py --points benchmarks/scaling/dlrm_main_4x2,...
        --hardware benchmarks/scaling/scaling_4x2_50mbit.hardware.json --out FILE   (one cluster size's)

`--fit-solo` fits Hardware.inter_node_solo_ratio with them (how much faster a rank's bytes cross once its node's
other ranks are through: the cost model's water filling of a node's link). Calibrate measures it as one rank alone
in a bare all-to-all (1.91 at 4 nodes x 2 ranks and 25 Mbit/s); in training at that size, a node whose ranks carry
uneven bytes ran as if it were 1.30 (the 4-node steps of benchmarks/scaling_dilated.md and of a 4-round run). Plans
whose nodes' ranks carry even bytes do not tell it: the fit needs one that does not.

Only sweeps that left the pipeline's last step out of their steps (sweep.json without last_step_measured) are read:
a step that counted it is too short by one input dist for its price to be compared.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from embark_torchrec.calibrate import stats
from embark_torchrec.plan import CostModel, ModelSpec, Plan, Topology
from embark_torchrec.plan.model.hardware_file import load_hardware, save_hardware
from embark_torchrec.plan.model.ranges import MAX_ONE_WAY_RATIO
from embark_torchrec.plan.model.topology import Hardware

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster_e2e import Rounds, display  # noqa: E402 (next to this file)
from sweep import kept_seeds, model_folder, set_plan_band  # noqa: E402

FITTED_RUNS = ("embark", "torchrec", "trw")  # the plans planned with the hardware file (torchrec-user's is not)
PAIRED_GRID = np.round(np.arange(0.50, 1.2001, 0.02), 2)
ONE_WAY_GRID = np.round(np.arange(1.0, MAX_ONE_WAY_RATIO + 0.001, 0.05), 2)
SOLO_STEP = 0.1  # --fit-solo's grid: 1.0 (no speed-up alone) up to the ranks per node (the whole link) by this
FIELDS = ("inter_node_paired_ratio", "inter_node_one_way_ratio", "inter_node_solo_ratio")


@dataclass(frozen=True)
class RanPlan:
    """One plan a sweep ran: what prices it (its model at the run's batch, its topology's shape, its model's
    hardware file) and its measured step (the median over rounds of the step less the batch making)."""

    model: str
    run: str
    spec: ModelSpec
    world_size: int
    local_world_size: int
    hardware: Hardware
    plan: Plan
    measured_ms: float
    rounds: Rounds  # the model's rounds of every run (its estimates unset)

    def priced_ms(self, hardware: Hardware) -> float:
        """The plan's estimated step on `hardware` (its model and topology's shape as it ran)."""
        cost = CostModel(self.spec, Topology(self.world_size, self.local_world_size, hardware))
        return cost.evaluate(self.plan).step_ms

    def estimated_ms(self, paired: float, one_way: float, phase_overlap: float, solo: float | None = None) -> float:
        """Priced at these link figures; `solo` None keeps the plan's file's inter_node_solo_ratio."""
        return self.priced_ms(
            self.hardware.with_overrides(
                inter_node_paired_ratio=paired,
                inter_node_one_way_ratio=one_way,
                inter_node_phase_overlap=phase_overlap,
                inter_node_solo_ratio=solo,
            )
        )

    def log_error(self, paired: float, one_way: float, phase_overlap: float, solo: float | None = None) -> float:
        return float(np.log(self.estimated_ms(paired, one_way, phase_overlap, solo) / self.measured_ms))


def model_speedups(plans: list[RanPlan], estimated_ms: Callable[[RanPlan], float]) -> dict[str, tuple[float, float]]:
    """Per model, embark's predicted and measured speedup over torchrec (as benchmarks/sweep.py measures it), each
    plan priced by `estimated_ms`."""
    by_model: dict[str, dict[str, RanPlan]] = {}
    for p in plans:
        by_model.setdefault(p.model, {})[p.run] = p
    out = {}
    for model, runs in by_model.items():
        estimated = {run: estimated_ms(runs[run]) for run in ("embark", "torchrec")}
        rounds = Rounds(runs["embark"].rounds.runs, estimated)
        out[model] = (rounds.predicted("embark", "torchrec"), rounds.measured("embark", "torchrec"))
    return out


def same_plan(plans: list[RanPlan], model: str) -> bool:
    """Whether embark ran TorchRec's plan (table by table) on `model`: no plan difference to measure."""
    runs = {p.run: p.plan for p in plans if p.model == model}
    return runs["embark"].tables == runs["torchrec"].tables


def model_misses(plans: list[RanPlan], estimated_ms: Callable[[RanPlan], float]) -> dict[str, float]:
    """Per model, |predicted - measured| speedup of embark over torchrec, each plan priced by `estimated_ms`: the
    error on plan differences that pricing leaves."""
    return {model: abs(p - m) for model, (p, m) in model_speedups(plans, estimated_ms).items()}


def speedup_misses(plans: list[RanPlan], figures: tuple[float, float, float, float | None]) -> dict[str, float]:
    """model_misses with the plans priced at `figures` (paired, one-way, phase overlap, solo or None: the files')."""
    return model_misses(plans, lambda plan: plan.estimated_ms(*figures))


def ran_plans(sweep: Path) -> list[RanPlan]:
    """Every fitted run of every model a sweep kept; a sweep that counted the pipeline's last step is refused."""
    settings_file = sweep.with_suffix("") / "sweep.json"
    if not settings_file.exists():
        raise SystemExit(f"{settings_file}: no kept sweep there (run benchmarks/sweep.py first)")
    if json.loads(settings_file.read_text()).get("last_step_measured", False):
        raise SystemExit(f"{settings_file}: its steps counted the pipeline's last step; run it again (--remeasure)")
    out = []
    for seed in kept_seeds(sweep.with_suffix("")):
        folder = model_folder(sweep, seed)
        rounds = json.loads((folder / "rounds.json").read_text())
        ws = rounds["world_size"]
        spec = ModelSpec.from_dict(json.loads((folder / "spec.json").read_text())).with_batch_size(
            rounds["batch_size"] * ws
        )
        hardware = load_hardware(folder / "hardware.json")
        kept = Rounds(rounds["runs"], {})
        for run in FITTED_RUNS:
            plan = Plan.load(folder / f"{run}.plan.json")
            lws = rounds["local_world_size"]
            out.append(RanPlan(f"seed {seed}", run, spec, ws, lws, hardware, plan, kept.measured_ms(run), kept))
    return out


def point_plans(folder: Path) -> list[RanPlan]:
    """Every run of one point benchmarks/scaling.py kept (benchmarks/scaling/<model>_<N>x<G>/: its model, its
    size's hardware file with the model's dense part, its plans and rounds), to fit the ratios at that size."""
    from scaling import load_spec  # the example's models, as scaling.py planned them

    rounds_file = folder / "rounds.json"
    if not rounds_file.exists():
        raise SystemExit(f"{rounds_file}: no kept scaling point there (run benchmarks/scaling.py first)")
    rounds = json.loads(rounds_file.read_text())
    first = next(iter(rounds["runs"].values()))[0]
    ws, lws = first["world_size"], first["local_world_size"]
    spec = load_spec(rounds["model"], None).with_batch_size(first["batch_size"] * ws)
    hardware = load_hardware(folder / "hardware.json")
    kept = Rounds(rounds["runs"], {})
    return [
        RanPlan(
            folder.name,
            run,
            spec,
            ws,
            lws,
            hardware,
            Plan.load(folder / f"{run}.plan.json"),
            kept.measured_ms(run),
            kept,
        )
        for run in rounds["runs"]
        if run in FITTED_RUNS
    ]


def solo_grid(plans: list[RanPlan]) -> np.ndarray:
    """--fit-solo's values: from 1.0 (a rank alone on its node's link gets no more than its share) to the plans'
    ranks per node (it gets the whole link), by SOLO_STEP."""
    top = max(p.local_world_size for p in plans)
    return np.round(np.arange(1.0, top + SOLO_STEP / 2, SOLO_STEP), 3)


def fit(
    plans: list[RanPlan],
    phase_overlap: float,
    one_way_grid: np.ndarray = ONE_WAY_GRID,
    solos: np.ndarray | None = None,
) -> tuple[tuple[float, float, float | None], list[float]]:
    """The grid's (paired, one-way, solo) ratios of least squared log error over the plans, priced at
    `phase_overlap`, and each plan's log error at them; `one_way_grid` a single value holds the one-way ratio there;
    `solos` None keeps each plan's file's solo ratio (the third figure None)."""
    solo_values: list[float | None] = [None] if solos is None else [float(x) for x in solos]
    errors = {
        (float(p), float(o), s): [plan.log_error(float(p), float(o), phase_overlap, s) for plan in plans]
        for p, o, s in itertools.product(PAIRED_GRID, one_way_grid, solo_values)
    }
    best = min(errors, key=lambda ratios: float(np.sum(np.square(errors[ratios]))))
    return best, errors[best]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweeps", default="", help="comma-separated sweep markdowns whose folders hold kept rounds")
    p.add_argument(
        "--points",
        default="",
        help="comma-separated folders of points benchmarks/scaling.py kept (benchmarks/scaling/<model>_<N>x<G>): "
        "the ratios of one cluster size",
    )
    p.add_argument("--hardware", type=Path, required=True, help="the cluster's calibrated hardware file")
    p.add_argument("--out", type=Path, required=True, help="where the file with the fitted ratios is written")
    p.add_argument(
        "--phase-overlap",
        type=float,
        help="Hardware.inter_node_phase_overlap to price with and write (default: --hardware's)",
    )
    p.add_argument(
        "--one-way",
        type=float,
        help="hold the one-way ratio at this (fitted on more plans elsewhere) and fit the paired ratio alone: a few "
        "plans, as one size's scaling points, do not pin both",
    )
    p.add_argument(
        "--fit-solo",
        action="store_true",
        help="fit Hardware.inter_node_solo_ratio too (1.0 up to the ranks per node): how much faster a rank's bytes "
        "cross once its node's other ranks are done, as training's steps show it rather than a bare all-to-all",
    )
    args = p.parse_args(argv)
    args.sweeps = [Path(s.strip()) for s in args.sweeps.split(",") if s.strip()]
    args.points = [Path(s.strip()) for s in args.points.split(",") if s.strip()]
    if not args.sweeps and not args.points:
        p.error("--sweeps / --points: give at least one sweep or scaling point")
    cluster = load_hardware(args.hardware)  # a bad file fails here
    if args.phase_overlap is None:
        args.phase_overlap = cluster.inter_node_phase_overlap
    elif not 0.0 <= args.phase_overlap <= 1.0:
        p.error(f"--phase-overlap {args.phase_overlap}: expected 0 to 1")
    if args.one_way is not None and not 1.0 <= args.one_way <= MAX_ONE_WAY_RATIO:
        p.error(f"--one-way {args.one_way}: expected 1 to {MAX_ONE_WAY_RATIO}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plans = [p for sweep in args.sweeps for p in ran_plans(sweep)]
    plans += [p for point in args.points for p in point_plans(point)]
    one_way_grid = ONE_WAY_GRID if args.one_way is None else np.array([args.one_way])
    solos = solo_grid(plans) if args.fit_solo else None
    ratios, errors = fit(plans, args.phase_overlap, one_way_grid, solos)
    before = [
        p.log_error(p.hardware.inter_node_paired_ratio, p.hardware.inter_node_one_way_ratio, args.phase_overlap)
        for p in plans
    ]
    for p, was, now in zip(plans, before, errors):
        print(f"{p.model:16} {p.run:9} estimated / measured {np.expm1(was):+.1%} -> {np.expm1(now):+.1%}")
    solo = "" if ratios[2] is None else f", solo ratio {ratios[2]:.2f}"
    print(
        f"paired ratio {ratios[0]:.2f}, one-way ratio {ratios[1]:.2f}{solo} over {len(plans)} plans, phase overlap "
        f"{args.phase_overlap:g}: worst error "
        f"{np.abs(np.expm1(before)).max():.1%} -> {np.abs(np.expm1(errors)).max():.1%}, rms log error "
        f"{np.sqrt(np.mean(np.square(before))):.3f} -> {np.sqrt(np.mean(np.square(errors))):.3f}"
    )
    document = json.loads(args.hardware.read_text())
    document["hardware"]["inter_node_phase_overlap"] = args.phase_overlap
    document.setdefault("sources", {})["inter_node_phase_overlap"] = "measured"
    sweeps = ", ".join(str(display(s)) for s in (*args.sweeps, *args.points))
    one_way = (
        f"one-way {ONE_WAY_GRID[0]}-{ONE_WAY_GRID[-1]} by 0.05"
        if args.one_way is None
        else f"the one-way ratio held at {args.one_way:g} (--one-way)"
    )
    solo_range = "" if solos is None else f", solo {solos[0]:.1f}-{solos[-1]:g} by {SOLO_STEP}"
    for field, value in zip(FIELDS, ratios):
        if value is None:
            continue
        document["hardware"][field] = value
        document.setdefault("sources", {})[field] = "measured"
        document.setdefault("measurements", {})[field] = stats(
            [float(np.exp(e)) for e in errors],
            "estimated / measured step",
            f"fitted by benchmarks/fit_link_ratios.py with the other ratios: the figures (paired {PAIRED_GRID[0]}-"
            f"{PAIRED_GRID[-1]} by 0.02, {one_way}{solo_range}) of least squared log "
            f"error of estimated over measured steps of the {len(plans)} plans of {sweeps}; the samples are each "
            "plan's estimated / measured step at it",
        )
    figures = (ratios[0], ratios[1], args.phase_overlap, ratios[2])
    speedups = model_speedups(plans, lambda plan: plan.estimated_ms(*figures))
    where = f"{sweeps}, priced with the fitted ratios (benchmarks/fit_link_ratios.py: in sample)"
    differ = [m / p for model, (p, m) in speedups.items() if not same_plan(plans, model)]
    print("speedup misses: " + ", ".join(f"{m} {abs(p - x):.3f}" for m, (p, x) in speedups.items()))
    band = "the error on plan differences as --hardware had it (embark ran TorchRec's plan on every model)"
    if differ:
        below, above = set_plan_band(document, differ, where)
        band = f"plan_error_below {below}, plan_error_above {above}"
    save_hardware(args.out, document)
    print(f"wrote {args.out} with {band}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
