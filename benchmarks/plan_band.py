"""The cost model's error on plan differences, pooled over kept sweeps and written where the planner reads it.

Every plan difference the kept sweeps measured (embark's plan against each of TorchRec's, the calibrated and the
user's, where the two differ), each plan priced again with today's cost model and its model's hardware file
(benchmarks/sweep.py's `priced`), gives a ratio of measured to predicted speedup. The misses grow with the predicted
speedup (sweeps 4-11: ~4% of it under 1.45x, ~6% above), so the error is kept as fractions of the prediction, each
way: Hardware.plan_error_below (the largest shortfall), which decides whether the planner may leave TorchRec's plan,
and Hardware.plan_error_above (the largest excess), the band's upper end. One sweep's ten models leave the worst case
to chance; the pool's hundred-odd differences less so, and a fresh sweep planned with the pooled band is its test out
of sample.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_band.py --sweeps benchmarks/sweep4.md,...,benchmarks/sweep11.md
        --hardware benchmarks/sweep4_50mbit.hardware.json --out benchmarks/sweep12_50mbit.hardware.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from embark_torchrec.plan.model.hardware_file import load_hardware  # noqa: E402
from cluster_e2e import display  # noqa: E402 (next to this file)
from sweep import ModelOutcome, kept_seeds, model_folder, plan_differences, priced, write_error  # noqa: E402

# predicted speedups the pooled misses are shown by: where the error grows
BANDS = ((0.0, 1.2), (1.2, 1.45), (1.45, float("inf")))


def kept_outcomes(sweep: Path) -> list[ModelOutcome]:
    """A kept sweep's models, priced again (its folder: benchmarks/sweep4/ for benchmarks/sweep4.md)."""
    folder = sweep.with_suffix("")
    if not (folder / "sweep.json").exists():
        raise SystemExit(f"{folder / 'sweep.json'}: no kept sweep there (run benchmarks/sweep.py first)")
    return [priced(model_folder(sweep, seed)) for seed in kept_seeds(folder)]


def misses_by_prediction(outcomes: list[ModelOutcome]) -> list[str]:
    """Per range of predicted speedup: the plan differences, their worst shortfall and excess as fractions of the
    prediction and in points."""
    lines = []
    for low, high in BANDS:
        pairs = [(p, m) for p, m in plan_differences(outcomes) if low <= p < high]
        if not pairs:
            continue
        ratios = [m / p for p, m in pairs]
        points = [m - p for p, m in pairs]
        lines.append(
            f"predicted {low:.2f}-{high:.2f}x: {len(pairs)} differences, measured / predicted "
            f"{min(ratios):.3f}-{max(ratios):.3f} (median {statistics.median(ratios):.3f}), "
            f"measured - predicted {min(points):+.3f} to {max(points):+.3f}"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweeps", required=True, help="kept sweeps' pages, comma-separated")
    p.add_argument("--hardware", type=Path, required=True, help="the cluster's calibrated hardware file")
    p.add_argument("--out", type=Path, required=True, help="that file with the pooled band written in")
    args = p.parse_args(argv)
    args.sweeps = [Path(s) for s in args.sweeps.split(",") if s.strip()]
    if not args.sweeps:
        p.error("--sweeps: give at least one kept sweep")
    try:
        load_hardware(args.hardware)  # a bad file fails here, naming it and the field, before any sweep is priced
    except (OSError, ValueError) as e:
        p.error(f"--hardware: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    outcomes = [o for sweep in args.sweeps for o in kept_outcomes(sweep)]
    for line in misses_by_prediction(outcomes):
        print(line)
    sweeps = ", ".join(display(s) for s in args.sweeps)
    where = f"{len(plan_differences(outcomes))} plan differences of {len(outcomes)} models of {sweeps}, priced again"
    below, _ = write_error(args.hardware, args.out, outcomes, where)
    print(f"the planner leaves TorchRec's plan where ours is predicted over {1 / (1 - below):.3f}x its speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
