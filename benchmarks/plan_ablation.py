"""Where a model's predicted speedup goes wrong, table by table: embark's kept plan of a sweep's model with TorchRec's
layout of chosen tables put back ("swaps"), each variant run in interleaved rounds beside embark's and TorchRec's
plans, and each swap's measured change of the step beside the change the cost model prices it at.

A sweep's miss on a model (|predicted - measured| speedup of embark over TorchRec's plan) is the cost model's error on
one whole plan difference. The swaps split that difference into pieces: a swap whose priced change is off its
measured one by more than its rounds' spread is a mispriced piece (a table's cluster kind, its grid, the data-parallel
all-reduce it moves), while pieces each priced within their spread whose errors add up in one direction point at no
term of the model. The plans, the model's hardware file and the settings are the sweep's; nothing is planned. By
default every table whose layout differs between the two plans is swapped alone; --swap t5,t6 swaps tables together.
--plan NAME=FILE runs one more plan of the model (any layouts, e.g. a table of embark's plan laid out otherwise) the
same way, its change over embark's plan priced and measured beside the swaps'.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_ablation.py --sweep benchmarks/sweep7.md --seed 1199748406
        [--swap t0 --swap t5,t6 ...] [--plan t4-tw=t4_tw.plan.json ...] [--rounds 2]
        [--out benchmarks/plan_ablation.md]

The variants and their rounds are kept under --out's folder (seed<seed>/); every kept model is in the markdown.
--kept runs nothing and writes the markdown from them. Needs root (network namespaces), ip and tc.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from embark_torchrec.plan import Plan
from embark_torchrec.plan.layout.tables import TableLayout

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster_e2e import Rounds, cluster_ready  # noqa: E402 (next to this file)
from sweep import (  # noqa: E402
    RUNS,
    check_kept_model,
    interleaved_rounds,
    kept_cost,
    kept_model_flags,
    kept_model_rounds,
    kept_seeds,
    kept_spec,
    model_folder,
)

BASE, OTHER = "embark", "torchrec"  # the plans whose difference is split
SWAP = "swap-"  # a swap's run name: this and its tables joined by "+"
GIVEN = "plan-"  # a --plan's run name: this and its NAME


def differing_tables(base: Plan, other: Plan) -> list[str]:
    """The tables whose layouts differ between two plans of one model, in the base plan's order."""
    return [name for name, layout in base.tables.items() if layout != other.tables[name]]


def swapped(base: Plan, other: Plan, tables: tuple[str, ...]) -> Plan:
    """`base` with `other`'s layouts of `tables`."""
    plan = base
    for name in tables:
        plan = plan.replace_table(name, other.tables[name])
    return plan


def swap_name(tables: tuple[str, ...]) -> str:
    return SWAP + "+".join(tables)


def given_name(name: str) -> str:
    return GIVEN + name


def layout_label(layout: TableLayout) -> str:
    """A layout in a few words: its cluster, hierarchical, its grid and the ranks it is on."""
    if layout.kind.replicated:
        return layout.cluster
    ranks = sorted({r for cell in layout.ranks for r in cell})
    hierarchical = " hierarchical" if layout.hierarchical else ""
    return f"{layout.cluster}{hierarchical} {layout.num_row_slices}x{layout.num_col_slices} on {ranks}"


def change_label(base: Plan, plan: Plan) -> str:
    """The tables a plan lays out otherwise than `base`, each with both layouts."""
    tables = differing_tables(base, plan)
    return "; ".join(f"{t}: {layout_label(base.tables[t])} -> {layout_label(plan.tables[t])}" for t in tables)


@dataclass(frozen=True)
class Change:
    """One variant of embark's plan (a swap, or a --plan): its run, what it changes, its priced and measured step, and
    both changes over the base plan's step (the measured one per round too: its spread)."""

    run: str
    label: str
    priced_ms: float
    measured_ms: float
    priced_change_ms: float
    measured_change_ms: float
    round_changes_ms: list[float]

    @property
    def error_ms(self) -> float:
        """Priced change less measured change: > 0 where the cost model charges the swap more than it costs."""
        return self.priced_change_ms - self.measured_change_ms


@dataclass(frozen=True)
class Ablation:
    """One model's split: its two plans' priced and measured steps and speedup, every swap and every --plan."""

    seed: int
    sweep: str  # the kept sweep the model is of
    seconds: float  # the runs' time
    priced_ms: dict[str, float]
    measured_ms: dict[str, float]
    swaps: list[Change]
    given: list[Change]

    @property
    def predicted(self) -> float:
        return self.priced_ms[OTHER] / self.priced_ms[BASE]

    @property
    def measured(self) -> float:
        return self.measured_ms[OTHER] / self.measured_ms[BASE]


def ablation_of(folder: Path) -> Ablation:
    """A kept model's split (its folder: spec, hardware file, the plans and rounds.json), priced with today's model."""
    rounds = json.loads((folder / "rounds.json").read_text())
    cost = kept_cost(folder, kept_spec(folder), rounds)
    priced = {run: cost.evaluate(Plan.load(folder / f"{run}.plan.json")).step_ms for run in rounds["runs"]}
    kept = Rounds(rounds["runs"], priced)
    measured = {run: kept.measured_ms(run) for run in rounds["runs"]}
    base, base_rounds = Plan.load(folder / f"{BASE}.plan.json"), kept.round_steps_ms(BASE)

    def change(run: str) -> Change:
        return Change(
            run,
            change_label(base, Plan.load(folder / f"{run}.plan.json")),
            priced[run],
            measured[run],
            priced[run] - priced[BASE],
            measured[run] - measured[BASE],
            [v - b for v, b in zip(kept.round_steps_ms(run), base_rounds)],
        )

    swaps = [change(swap_name(tuple(t))) for t in rounds["swaps"]]
    given = [change(given_name(name)) for name in rounds.get("plans", [])]
    return Ablation(int(rounds["seed"]), rounds["sweep"], rounds["seconds"], priced, measured, swaps, given)


def markdown(ablations: list[Ablation], note: str) -> str:
    """Every kept model's split, and what the swaps' errors add up to."""
    lines = [
        "# Plan differences split table by table",
        "",
        "Embark's kept plan of a sweep's model with TorchRec's layout of some tables put back, each variant run in "
        "interleaved rounds beside the two plans (benchmarks/plan_ablation.py); steps are medians over rounds of the "
        "step less the batch making, priced with the model's hardware file. A swap's error is its priced change of "
        "the step less its measured change (> 0: charged more than it costs). " + note,
    ]
    for a in ablations:
        lines += [
            "",
            f"## Seed {a.seed}: embark / torchrec {a.measured:.3f}x measured, {a.predicted:.3f}x predicted "
            f"(miss {a.predicted - a.measured:+.3f})",
            "",
            f"embark: priced {a.priced_ms[BASE]:,.0f} ms, measured {a.measured_ms[BASE]:,.0f} ms; torchrec: priced "
            f"{a.priced_ms[OTHER]:,.0f} ms, measured {a.measured_ms[OTHER]:,.0f} ms.",
            "",
            "| embark's plan changed | by | priced | measured | change priced | change measured (rounds) | error |",
            "|---|---|---:|---:|---:|---|---:|",
        ]
        for s in a.swaps + a.given:
            by = "TorchRec's layout" if s in a.swaps else f"--plan {s.run.removeprefix(GIVEN)}"
            rounds = ", ".join(f"{c:+,.0f}" for c in s.round_changes_ms)
            lines.append(
                f"| {s.label} | {by} | {s.priced_ms:,.0f} | {s.measured_ms:,.0f} | {s.priced_change_ms:+,.0f} | "
                f"{s.measured_change_ms:+,.0f} ({rounds}) | {s.error_ms:+,.0f} |"
            )
        whole_priced = a.priced_ms[OTHER] - a.priced_ms[BASE]
        whole_measured = a.measured_ms[OTHER] - a.measured_ms[BASE]
        lines += [
            "",
            f"The whole difference: priced {whole_priced:+,.0f} ms, measured {whole_measured:+,.0f} ms (error "
            f"{whole_priced - whole_measured:+,.0f}); the swaps' errors add up to "
            f"{sum(s.error_ms for s in a.swaps):+,.0f} ms.",
        ]
    return "\n".join(lines) + "\n"


def prepare(
    sweep: Path, seed: int, swaps: list[tuple[str, ...]], folder: Path, given: Mapping[str, Plan] | None = None
) -> list[str]:
    """The model's spec, hardware file, both plans, every swap's variant and every --plan (`given`, by NAME) written
    into `folder`; the run names."""
    source = model_folder(sweep, seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("spec.json", "hardware.json"):
        shutil.copyfile(source / name, folder / name)
    base, other = Plan.load(source / f"{BASE}.plan.json"), Plan.load(source / f"{OTHER}.plan.json")
    plans = {BASE: base, OTHER: other} | {swap_name(t): swapped(base, other, t) for t in swaps}
    plans |= {given_name(name): plan for name, plan in (given or {}).items()}
    for run, plan in plans.items():
        (folder / f"{run}.plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
    return list(plans)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kept_model_flags(p, ROOT / "benchmarks" / "plan_ablation.md")
    p.add_argument(
        "--swap",
        action="append",
        default=[],
        help="comma-separated tables put back together (repeatable; default: every differing table alone)",
    )
    p.add_argument(
        "--plan",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="one more plan of the model, run and priced beside the swaps (repeatable; NAME labels it)",
    )
    args = p.parse_args(argv)
    if args.kept:
        return args
    check_kept_model(p, args)
    source = model_folder(args.sweep, args.seed)
    base, other = Plan.load(source / f"{BASE}.plan.json"), Plan.load(source / f"{OTHER}.plan.json")
    differing = differing_tables(base, other)
    if not differing:
        p.error(f"--seed {args.seed}: embark's plan is TorchRec's (nothing to split)")
    swaps = [tuple(t.strip() for t in s.split(",") if t.strip()) for s in args.swap] or [(t,) for t in differing]
    for tables in swaps:
        same = [t for t in tables if t not in differing]
        if same or not tables:
            p.error(f"--swap {','.join(tables)}: {same or 'no table'} not a table whose layout differs ({differing})")
    args.swaps = swaps
    spec = kept_spec(source)
    args.given = {}
    for item in args.plan:
        name, _, file = item.partition("=")
        if not name or not file or name in args.given:
            p.error(f"--plan {item}: expected NAME=FILE, each NAME once")
        try:
            plan = Plan.load(file)
            plan.validate(spec)
        except (OSError, ValueError) as e:
            p.error(f"--plan {item}: {e}")
        ran, shape = (base.world_size, base.local_world_size), (plan.world_size, plan.local_world_size)
        if shape != ran:
            p.error(f"--plan {item}: {file} is for (ranks, ranks per node) {shape}; the model ran on {ran}")
        if not differing_tables(base, plan):
            p.error(f"--plan {item}: {file} lays out every table as embark's plan does")
        args.given[name] = plan
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kept_folder = args.out.with_suffix("")
    if not args.kept:
        if not cluster_ready("plan_ablation.py"):
            return 1
        folder = kept_folder / f"seed{args.seed}"
        names = prepare(args.sweep, args.seed, args.swaps, folder, args.given)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            planners = {name: RUNS[BASE] for name in names}  # every variant runs as a plan file with the hardware file
            runs = interleaved_rounds(args, args.seed, folder, Path(tmp), names, True, planners)
        kept = kept_model_rounds(args, runs, time.perf_counter() - start)
        kept |= {"swaps": [list(t) for t in args.swaps], "plans": list(args.given)}
        (folder / "rounds.json").write_text(json.dumps(kept, indent=1))
    ablations = [ablation_of(kept_folder / f"seed{seed}") for seed in kept_seeds(kept_folder)]
    minutes = sum(a.seconds for a in ablations) / 60
    note = f"Models of {', '.join(sorted({a.sweep for a in ablations}))}; {minutes:.1f} min of runs in all."
    args.out.write_text(markdown(ablations, note))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
