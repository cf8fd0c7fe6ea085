"""How far refitting the hardware figures can take the cost model's error on plan differences, on kept sweeps.

benchmarks/fit_link_ratios.py fits two link ratios to the steps a sweep measured; this asks whether any setting of
the other figures the model has could do better. Every plan the sweeps ran (embark's, TorchRec's and table-row-wise,
each priced with its model's hardware file, the link ratios and phase overlap taken from --hardware) is priced
again with each figure 10% higher, which gives each plan's log estimate's sensitivity to each figure; the log
errors fitted as those sensitivities times the log of a factor per figure, by least squares over every subset of
1 to all of the figures, show how much of the error any of them explains (linearized). Then, priced exactly, a
coordinate search over the factors (each figure within x1/4 to x4 of its own, in turn, until no figure moves) for
the least worst speedup miss: per model, |predicted - measured| speedup of embark over TorchRec's plan (measured
as the sweeps measure it: the median of per-round ratios; the target 0.07). If even that setting leaves the worst
miss above the target, no refit of these figures reaches it, and the model's shape has to change.

Then the terms the model does not have: each plan's step less its price fitted, by least squares on relative errors,
as milliseconds per table of each sharding group it runs (TorchRec's sharding type, or our cluster kind, a
hierarchical one apart) plus milliseconds per step; each model's plans priced with the terms fitted on the other
models (left out one model at a time). A term the runtime pays and the model misses shows as a per-plan error that
shrinks out of sample; the speedup misses shrink with it only if the term differs between a model's plans.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_error_floor.py --sweeps benchmarks/sweep.md,benchmarks/sweep4.md
        --hardware benchmarks/sweep4_50mbit.hardware.json [--terms-only]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from embark_torchrec.plan.layout.groups import sharding_group
from embark_torchrec.plan.model.hardware_file import load_hardware
from embark_torchrec.plan.model.topology import Hardware

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from fit_link_ratios import FIELDS, RanPlan, model_misses, ran_plans  # noqa: E402 (next to this file)

FIGURES = (
    "allreduce_bus_gbps",
    "inter_node_bw_gbps",
    "intra_node_bw_gbps",
    "dense_ms_per_ksample",
    "hbm_bw_gbps",
    "update_ns_per_row",
    "inter_node_solo_ratio",
)
STEP = 1.1  # each figure's move to read a plan's sensitivity to it
GRID = 2.0 ** np.array([-2.0, -1.0, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5, 1.0, 2.0])  # a coordinate step's factors


def estimated_ms(plan: RanPlan, links: dict[str, float], factors: dict[str, float]) -> float:
    """The plan's estimated step with --hardware's link figures and each figure of `factors` scaled by it."""
    hardware: Hardware = plan.hardware.with_overrides(**links)
    return plan.priced_ms(hardware.with_overrides(**{f: getattr(hardware, f) * k for f, k in factors.items()}))


def speedup_misses(plans: list[RanPlan], errors: Sequence[float]) -> list[float]:
    """Per model, |predicted - measured| speedup of embark over TorchRec's plan as the sweeps measure it
    (fit_link_ratios.model_misses), each plan's estimate its measured step x exp(its entry of `errors`)."""
    estimated = {id(plan): plan.measured_ms * float(np.exp(e)) for plan, e in zip(plans, errors)}
    return list(model_misses(plans, lambda plan: estimated[id(plan)]).values())


def least_worst_miss(plans: list[RanPlan], links: dict[str, float]) -> tuple[dict[str, float], float]:
    """The factors on FIGURES (each within x1/4 to x4 of the plans' own) of the least worst speedup miss, priced
    exactly, by a coordinate search (each figure in turn over GRID, until no figure moves), and that miss."""
    measured = np.array([plan.measured_ms for plan in plans])

    def worst(candidate: dict[str, float]) -> float:
        priced = np.array([estimated_ms(plan, links, candidate) for plan in plans])
        return max(speedup_misses(plans, np.log(priced / measured)))

    factors = {f: 1.0 for f in FIGURES}
    least, moved = worst(factors), True
    while moved:
        moved = False
        for figure in FIGURES:
            for step in GRID:
                factor = factors[figure] * float(step)
                if not 0.25 <= factor <= 4.0:
                    continue
                candidate = factors | {figure: factor}
                miss = worst(candidate)
                if miss < least - 1e-6:
                    factors, least, moved = candidate, miss, True
    return factors, least


PER_STEP = "per step"  # missing_terms' constant: the same milliseconds on every step of every plan


def group_counts(plan: RanPlan) -> dict[str, int]:
    """The plan's tables per sharding group it runs in (the group's runner, "_hier" where it is hierarchical)."""
    tables = {t.name: t for t in plan.spec.tables}
    counts: dict[str, int] = {}
    for name, layout in plan.plan.tables.items():
        table = tables[name]
        group = sharding_group(layout, table.rows, plan.world_size, plan.local_world_size, table.is_sequence)
        key = group.runner + ("_hier" if group.hierarchical else "")
        counts[key] = counts.get(key, 0) + 1
    return counts


def missing_terms(plans: list[RanPlan], priced: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """The terms (ms per table of each group, ms PER_STEP) that best explain measured - `priced` over `plans`, least
    squares on errors relative to the measured step: the terms, their ms fitted on every plan, and each plan's
    estimate with them in sample and out of sample (its model's plans priced with the terms the others fitted)."""
    counts = [group_counts(plan) for plan in plans]
    terms = sorted({g for c in counts for g in c}) + [PER_STEP]
    design = np.array([[c.get(t, 0) for t in terms[:-1]] + [1.0] for c in counts])
    measured = np.array([plan.measured_ms for plan in plans])
    weights = 1.0 / measured

    def fitted(rows: np.ndarray) -> np.ndarray:
        ms, *_ = np.linalg.lstsq(
            design[rows] * weights[rows, None], (measured - priced)[rows] * weights[rows], rcond=None
        )
        return ms

    every = fitted(np.ones(len(plans), dtype=bool))
    out_of_sample = np.empty(len(plans))
    models = np.array([plan.model for plan in plans])
    for model in dict.fromkeys(models):
        left = models == model
        out_of_sample[left] = priced[left] + design[left] @ fitted(~left)
    return terms, every, priced + design @ every, out_of_sample


def describe_misses(plans: list[RanPlan], estimated: np.ndarray) -> str:
    """The rms log error of `estimated` over the plans' measured steps, and their speedup misses (worst, rms, how
    many over the 0.07 target)."""
    errors = np.log(estimated / np.array([plan.measured_ms for plan in plans]))
    misses = np.array(speedup_misses(plans, errors))
    return (
        f"rms log error {np.sqrt(np.mean(errors**2)):.4f}; speedup misses worst {misses.max():.3f}, rms "
        f"{np.sqrt(np.mean(misses**2)):.3f}, {int(np.sum(misses > 0.07))} of {len(misses)} over 0.07"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweeps", required=True, help="comma-separated sweep markdowns whose folders hold kept rounds")
    p.add_argument("--hardware", type=Path, required=True, help="the file whose link ratios and phase overlap price")
    p.add_argument(
        "--terms-only",
        action="store_true",
        help="the missing terms' fit alone (seconds; the figures' search takes minutes)",
    )
    args = p.parse_args(argv)
    sweeps = [Path(s.strip()) for s in args.sweeps.split(",") if s.strip()]
    if not sweeps:
        p.error("--sweeps: give at least one sweep")
    cluster = load_hardware(args.hardware)
    links = {f: getattr(cluster, f) for f in (*FIELDS, "inter_node_phase_overlap")}
    plans = [plan for sweep in sweeps for plan in ran_plans(sweep)]
    base = np.array([estimated_ms(plan, links, {}) for plan in plans])
    terms, ms, in_sample, out_of_sample = missing_terms(plans, base)
    print(f"{len(plans)} plans of {len(set(p.model for p in plans))} models as priced: " + describe_misses(plans, base))
    print("missing terms fitted: " + ", ".join(f"{t} {v:+.1f} ms" for t, v in zip(terms, ms)))
    print("  in sample: " + describe_misses(plans, in_sample))
    print("  each model left out of its fit: " + describe_misses(plans, out_of_sample))
    if args.terms_only:
        return 0
    errors = np.log(base / np.array([plan.measured_ms for plan in plans]))
    sensitivity = np.array(
        [
            [np.log(estimated_ms(plan, links, {f: STEP}) / b) / np.log(STEP) for f in FIGURES]
            for plan, b in zip(plans, base)
        ]
    )
    print(
        f"{len(plans)} plans of {len(set(p.model for p in plans))} models: rms log error "
        f"{np.sqrt(np.mean(errors**2)):.4f}, worst speedup miss {max(speedup_misses(plans, errors)):.3f}"
    )
    for k in range(1, len(FIGURES) + 1):
        fits = []
        for subset in itertools.combinations(range(len(FIGURES)), k):
            logs, *_ = np.linalg.lstsq(sensitivity[:, subset], -errors, rcond=None)
            left = errors + sensitivity[:, subset] @ logs
            fits.append((float(np.sum(left**2)), subset, logs, left))
        _, subset, logs, left = min(fits, key=lambda f: f[0])
        factors = {FIGURES[i]: float(np.exp(x)) for i, x in zip(subset, logs)}
        print(
            f"{k} figure(s): "
            + ", ".join(f"{f} x{v:.3g}" for f, v in factors.items())
            + f": rms log error {np.sqrt(np.mean(left**2)):.4f}, worst speedup miss "
            f"{max(speedup_misses(plans, left)):.3f}"
        )
    factors, least = least_worst_miss(plans, links)
    measured = np.array([plan.measured_ms for plan in plans])
    exact = np.log(np.array([estimated_ms(plan, links, factors) for plan in plans]) / measured)
    print(
        "least worst speedup miss, priced exactly: "
        + ", ".join(f"{f} x{v:.3g}" for f, v in factors.items() if v != 1.0)
        + f": worst speedup miss {least:.3f}, rms log error {np.sqrt(np.mean(exact**2)):.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
