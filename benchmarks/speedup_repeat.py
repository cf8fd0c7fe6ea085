"""How far a sweep's measured speedup moves when the same plans run again: embark's and TorchRec's kept plans of
chosen models of a kept sweep (benchmarks/sweep.py's folder) in fresh interleaved rounds on the same emulated cluster
settings, beside what the sweep measured and what the cost model predicts for them.

A sweep's miss (|predicted - measured| speedup of embark over TorchRec's plan) holds the cost model's error on plan
differences and the measurement's own: the sweep measures each model once, in rounds a few minutes apart, so a box
that runs one plan a few percent differently for those minutes moves that model's speedup, and at 1.7x a 4% move is
7 points. Running the same plans again, later, shows how much of a miss is the measurement's: the plans, the model's
hardware file and the settings are the sweep's, nothing is planned, and each model's runs alternate as the sweep's
did (every other round in reverse).

    PYTHONPATH=. .venv/bin/python benchmarks/speedup_repeat.py --sweep benchmarks/sweep4.md
        [--seeds 1336613812,706715217] [--rounds 2] [--out benchmarks/sweep4_repeat.md]

The new rounds are kept as <out's folder>/seed<seed>.json. Needs root (network namespaces), ip and tc.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster_e2e import TIMEOUT_S, Rounds, cluster_ready, display  # noqa: E402 (next to this file)
from e2e import round_ratios  # noqa: E402
from sweep import (  # noqa: E402
    SPEEDUP_TARGET,
    interleaved_rounds,
    kept_seeds,
    kept_settings,
    model_folder,
    priced,
)

PAIR = ("embark", "torchrec")  # the speedup the sweep's 7-point target is about, run again


@dataclass(frozen=True)
class Repeat:
    """One model: its speedup as the sweep measured it (per round and the median), as the cost model predicts it,
    and as the new rounds measured it."""

    seed: int
    predicted: float
    sweep_rounds: list[float]
    sweep: float
    again_rounds: list[float]
    again: float

    @property
    def sweep_miss(self) -> float:
        return abs(self.predicted - self.sweep)

    @property
    def again_miss(self) -> float:
        return abs(self.predicted - self.again)

    @property
    def shift(self) -> float:
        """The measured speedup's move between the sweep and the new rounds."""
        return self.again - self.sweep


def repeat_of(folder: Path, again: dict[str, list[dict[str, Any]]]) -> Repeat:
    """A model's Repeat from its kept folder (its rounds priced with today's cost model) and the new rounds."""
    kept = priced(folder)
    fresh = Rounds(again, kept.estimated_ms)
    return Repeat(
        kept.seed,
        kept.predicted(*PAIR),
        round_ratios(kept.runs, *PAIR, "samples_per_s"),
        kept.measured(*PAIR),
        round_ratios(again, *PAIR, "samples_per_s"),
        fresh.measured(*PAIR),
    )


def markdown(repeats: list[Repeat], args: argparse.Namespace, seconds: float) -> str:
    """The table of every model repeated so far, and the line that reruns them."""

    def ratios(values: list[float]) -> str:
        return ", ".join(f"{v:.3f}" for v in values)

    lines = [
        f"# The sweep's speedups measured again: {display(args.sweep)}",
        "",
        f"Embark's and TorchRec's kept plans of {len(repeats)} of its models, run again in "
        f"{max(len(r.again_rounds) for r in repeats)} fresh interleaved rounds with the sweep's settings (nothing "
        "planned again); speedups are medians of per-round "
        f"samples/s ratios, predicted ones the estimated steps' ratio (today's cost model). {seconds / 60:.1f} min.",
        "",
        "| seed | predicted | sweep measured (rounds) | again measured (rounds) | shift | miss: sweep, again |",
        "|---|---:|---|---|---:|---|",
    ]
    for r in repeats:
        lines.append(
            f"| {r.seed} | {r.predicted:.3f}x | {r.sweep:.3f}x ({ratios(r.sweep_rounds)}) | {r.again:.3f}x "
            f"({ratios(r.again_rounds)}) | {r.shift:+.3f} | {r.sweep_miss:.3f}, {r.again_miss:.3f} |"
        )
    within = sum(r.again_miss <= SPEEDUP_TARGET for r in repeats)
    lines += [
        "",
        f"Measured again, {within} of {len(repeats)} within {SPEEDUP_TARGET} of predicted; the measured speedup "
        f"moved by {min(abs(r.shift) for r in repeats):.3f}-{max(abs(r.shift) for r in repeats):.3f} between the "
        "sweep and now.",
        "",
        f"Rerun: `{' '.join(['PYTHONPATH=. .venv/bin/python benchmarks/speedup_repeat.py', *args.rerun])}`",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", type=Path, required=True, help="a kept sweep's markdown (its folder holds the models)")
    p.add_argument("--seeds", default="", help="comma-separated seeds of its models (default: every kept model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, help="the markdown written (default: the sweep's, with _repeat)")
    p.add_argument(
        "--kept", action="store_true", help="run nothing: the new rounds kept under --out's folder, priced again"
    )
    args = p.parse_args(argv)
    args.rerun = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--kept"]
    settings_file = args.sweep.with_suffix("") / "sweep.json"
    if not settings_file.exists():
        p.error(f"--sweep {args.sweep}: {settings_file} holds no kept sweep")
    kept = kept_seeds(args.sweep.with_suffix(""))
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()] or kept
    except ValueError as e:
        p.error(f"--seeds: {e}")
    missing = sorted(set(args.seeds) - set(kept))
    if missing:
        p.error(f"--seeds {missing}: not models {args.sweep.with_suffix('')} kept rounds of (it has {kept})")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not args.kept:  # the runs take the sweep's settings
        settings = json.loads(settings_file.read_text())
        try:
            vars(args).update(kept_settings(settings))
        except KeyError as unset:
            p.error(f"--sweep {args.sweep}: {settings_file} lacks the settings {unset.args[0]} to run its plans with")
        args.timeout_s = TIMEOUT_S
    args.out = args.out or args.sweep.with_name(f"{args.sweep.stem}_repeat.md")
    return args


def kept_again(out: Path, seed: int) -> dict[str, Any]:
    """The new rounds of one model kept under --out's folder (with the minutes they took)."""
    kept = out.with_suffix("") / f"seed{seed}.json"
    if not kept.exists():
        raise SystemExit(f"{kept}: no rounds kept for seed {seed} (run without --kept first)")
    return json.loads(kept.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.kept and not cluster_ready("speedup_repeat.py"):
        return 1
    repeats, seconds = [], 0.0
    args.out.with_suffix("").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_dir:
        for seed in args.seeds:
            folder = model_folder(args.sweep, seed)
            if args.kept:
                again = kept_again(args.out, seed)
            else:
                start = time.perf_counter()
                runs = interleaved_rounds(args, seed, folder, Path(tmp_dir), list(PAIR), planned=True)
                again = {"seed": seed, "runs": runs}
                again["seconds"] = time.perf_counter() - start
                (args.out.with_suffix("") / f"seed{seed}.json").write_text(json.dumps(again, indent=1))
            seconds += again["seconds"]
            repeats.append(repeat_of(folder, again["runs"]))
            args.out.write_text(markdown(repeats, args, seconds))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
