"""Hardware.inter_node_paired_ratio fitted to real training steps: the rate at which the hierarchical stage 2 and
TorchRec's table-row-wise cross nodes (each rank with its local rank's peer on every other node), over the
all-ranks rate, as the kept sweeps' steps show it.

Calibrate measures the ratio with a bare all-to-all per cross-node group, sample by sample against the all-ranks
pattern; on this box's gloo links its samples spread too far to price a plan by (24 samples: p25-p75 0.67-1.18,
median 0.97), while every table-row-wise plan of sweep 3 ran 3-18% slower than a ratio of 0.97 prices it, more
the more of its bytes cross in pairs. So the figure is read off the steps themselves: every plan the sweeps ran
(embark's, TorchRec's and table-row-wise, each priced with its model's own hardware file) is priced again at
each ratio of a grid, and the ratio with the least squared log error of estimated over measured steps is kept.
The other figures are the cluster's as calibrated; only this one is fitted, and it is written into a copy of
--hardware with the fit's residuals as its measurement.

    PYTHONPATH=. .venv/bin/python benchmarks/fit_paired_ratio.py --sweeps benchmarks/sweep.md
        --hardware benchmarks/sweep3_50mbit.hardware.json --out benchmarks/sweep4_50mbit.hardware.json

Only sweeps that left the pipeline's last step out of their steps (sweep.json without last_step_measured) are read:
a step that counted it is too short by one input dist for its price to be compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embark_torchrec.calibrate import stats
from embark_torchrec.plan import CostModel, ModelSpec, Plan, Topology
from embark_torchrec.plan.model.hardware_file import load_hardware, save_hardware
from embark_torchrec.plan.model.topology import Hardware

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster_e2e import display  # noqa: E402 (next to this file)
from sweep import kept_seeds, model_folder  # noqa: E402

FITTED_RUNS = ("embark", "torchrec", "trw")  # the plans planned with the hardware file (torchrec-user's is not)
GRID = np.round(np.arange(0.50, 1.2001, 0.01), 2)


@dataclass(frozen=True)
class RanPlan:
    """One plan a sweep ran: what prices it (its model at the run's batch, its topology's shape, its model's
    hardware file) and its measured step (the median over rounds of the step less the batch making)."""

    name: str
    spec: ModelSpec
    world_size: int
    local_world_size: int
    hardware: Hardware
    plan: Plan
    measured_ms: float

    def log_error(self, paired_ratio: float) -> float:
        hardware = self.hardware.with_overrides(inter_node_paired_ratio=paired_ratio)
        estimated = CostModel(self.spec, Topology(self.world_size, self.local_world_size, hardware))
        return float(np.log(estimated.evaluate(self.plan).step_ms / self.measured_ms))


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
        for run in FITTED_RUNS:
            measured = statistics.median(r["step_ms"] - r["data_ms_per_step"] for r in rounds["runs"][run])
            plan = Plan.load(folder / f"{run}.plan.json")
            out.append(RanPlan(f"seed {seed} {run}", spec, ws, rounds["local_world_size"], hardware, plan, measured))
    return out


def fit(plans: list[RanPlan]) -> tuple[float, list[float]]:
    """The grid's ratio of least squared log error over the plans, and each plan's log error at it."""
    errors = {ratio: [p.log_error(float(ratio)) for p in plans] for ratio in GRID}
    best = min(errors, key=lambda ratio: float(np.sum(np.square(errors[ratio]))))
    return float(best), errors[best]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweeps", required=True, help="comma-separated sweep markdowns whose folders hold kept rounds")
    p.add_argument("--hardware", type=Path, required=True, help="the cluster's calibrated hardware file")
    p.add_argument("--out", type=Path, required=True, help="where the file with the fitted ratio is written")
    args = p.parse_args(argv)
    args.sweeps = [Path(s.strip()) for s in args.sweeps.split(",") if s.strip()]
    if not args.sweeps:
        p.error("--sweeps: give at least one sweep")
    load_hardware(args.hardware)  # a bad file fails here
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plans = [p for sweep in args.sweeps for p in ran_plans(sweep)]
    ratio, errors = fit(plans)
    at_calibrated = [p.log_error(p.hardware.inter_node_paired_ratio) for p in plans]
    for p, before, after in zip(plans, at_calibrated, errors):
        print(f"{p.name:28} estimated / measured {np.exp(before) - 1:+.1%} -> {np.exp(after) - 1:+.1%}")
    print(
        f"paired ratio {ratio:.2f} over {len(plans)} plans: worst error {np.abs(np.expm1(at_calibrated)).max():.1%} "
        f"-> {np.abs(np.expm1(errors)).max():.1%}, rms log error {np.sqrt(np.mean(np.square(at_calibrated))):.3f} "
        f"-> {np.sqrt(np.mean(np.square(errors))):.3f}"
    )
    document = json.loads(args.hardware.read_text())
    document["hardware"]["inter_node_paired_ratio"] = ratio
    document.setdefault("sources", {})["inter_node_paired_ratio"] = "measured"
    sweeps = ", ".join(str(display(s)) for s in args.sweeps)
    document.setdefault("measurements", {})["inter_node_paired_ratio"] = stats(
        [float(np.exp(e)) for e in errors],
        "estimated / measured step",
        f"fitted by benchmarks/fit_paired_ratio.py: the ratio (grid {GRID[0]}-{GRID[-1]} by 0.01) of least squared "
        f"log error of estimated over measured steps of the {len(plans)} plans of {sweeps}; the samples are each "
        "plan's estimated / measured step at it",
    )
    save_hardware(args.out, document)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
