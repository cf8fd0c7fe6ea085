"""python -m embark_torchrec.plan MODEL --world-size W --local-world-size L [...]

Plans MODEL (a spec file, or a built-in name: dcnv2, t180, t200, t510), prints the report (or one
JSON object with --json), writes the plan file with --out, and compares with the baselines named
by --compare, all scored by the same cost model.

The baselines are main's parameter: here the pure ones (trw); `python -m embark_torchrec.planner` runs the same
main adding TorchRec's default planner (torchrec), which needs torchrec, so that this command never imports it.

Every user error (bad arguments, a bad spec or hardware file, a number beyond its plannable range, an output
path that cannot be written, a model that does not fit) is one line on stderr and exit code 2, before any
planning where it can be; a plan whose estimated cost is not finite is neither written nor printed (exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, NoReturn, Sequence


from .search.baselines import table_row_wise_plan
from .cost.bound import step_lower_bound
from .cost.model import CostModel
from .model.fields import INT64_MAX, integer, number
from .layout.tables import Plan
from .plan_model import check_finite, plan_model
from .progress import ProgressLine, progress_line
from .report import ScoredPlan, plot_rank_loads, render, summary
from .model.spec import ModelSpec, SpecError, builtin_model, load_model_spec
from .model.hardware_file import HardwareError, resolve_hardware
from .model.ranges import MAX_BATCH_SIZE, MAX_HBM_GB, MAX_WORLD_SIZE, planned_world_size_refusal
from .model.topology import DEFAULT_HARDWARE, PRESETS, Hardware, Topology


class UsageError(Exception):
    """A user error: main prints it as one line and exits with 2."""


# A baseline: the plan another planner makes for a model on a topology, scored beside ours.
Baseline = Callable[[ModelSpec, Topology], Plan]

PROG = "python -m embark_torchrec.plan"
BASELINES: Mapping[str, Baseline] = {"trw": table_row_wise_plan}
# baselines that need torchrec, which this command keeps out: the command that has them
ELSEWHERE = {"torchrec": "python -m embark_torchrec.planner"}
_SPEC_SUFFIXES = (".json", ".yaml", ".yml")


def _count(maximum: int = INT64_MAX) -> Callable[[str], int]:
    """An argument that counts something (ranks, samples): an integer in [1, maximum]."""
    bound = ">= 1" if maximum == INT64_MAX else f"in [1, {maximum}]"

    def parse(value: str) -> int:
        try:
            return integer(int(value), "", minimum=1, maximum=maximum)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {value!r}") from None

    return parse


def _measure(maximum: float) -> Callable[[str], float]:
    """An argument that measures something (GB): a finite number in (0, maximum] (not nan, not inf)."""

    def parse(value: str) -> float:
        try:
            return number(float(value), "", at_most=maximum)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a finite number in (0, {maximum:g}], got {value!r}") from None

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are UsageErrors (one line, no usage dump), so that main reports them."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parse_args(
    argv: Sequence[str] | None = None, prog: str = PROG, baselines: Mapping[str, Baseline] = BASELINES
) -> argparse.Namespace:
    p = _Parser(prog=prog, description=__doc__.split("\n\n")[1])
    p.add_argument("model", help="model spec file (JSON/YAML) or built-in model name")
    p.add_argument("--world-size", type=_count(MAX_WORLD_SIZE), required=True)
    p.add_argument("--local-world-size", type=_count(MAX_WORLD_SIZE), required=True)
    p.add_argument("--batch-size", type=_count(MAX_BATCH_SIZE), help="global batch size (default: the spec's)")
    p.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a hardware file (JSON; python -m embark_torchrec.calibrate)",
    )
    p.add_argument("--hbm-gb", type=_measure(MAX_HBM_GB), help="override the preset's memory per GPU")
    p.add_argument("--out", type=Path, help="write the plan file here")
    p.add_argument("--compare", default="", help=f"comma-separated baselines: {', '.join(baselines)}")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--plot", type=Path, help="write a PNG of per-rank load for each plan")
    return p.parse_args(argv)


def check_output(flag: str, path: Path | None) -> None:
    """Refuses, before planning, an output path that cannot be written: its directory missing or
    read-only, or the path an existing directory or read-only file."""
    if path is None:
        return
    parent = path.parent
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def _load_model(model: str) -> ModelSpec:
    """A spec file, or a built-in model; a name that looks like a file but is none is refused as such."""
    path = Path(model)
    if path.exists():
        return load_model_spec(path)
    if path.suffix in _SPEC_SUFFIXES or os.sep in model:
        raise SpecError("no such file", file=model)
    return builtin_model(model)


def _load_hardware(value: str, hbm_gb: float | None) -> Hardware:
    """--hardware: a preset name or a hardware file; an error names the flag (and the file and field).
    --hbm-gb replaces its memory per GPU, which must stay above its reserve."""
    try:
        hardware = resolve_hardware(value)
    except HardwareError as e:  # names the file already
        raise UsageError(f"--hardware: {e}") from None
    except ValueError as e:
        raise UsageError(f"--hardware {value}: {e}") from None
    if hbm_gb is not None and hbm_gb <= hardware.hbm_reserve_gb:
        raise UsageError(
            f"--hbm-gb {hbm_gb:g}: leaves no memory for embeddings beside the hardware's reserve of "
            f"{hardware.hbm_reserve_gb:g} GB (hbm_reserve_gb of {value})"
        )
    return hardware.with_overrides(hbm_gb=hbm_gb)


def _check_baselines(compare: list[str], baselines: Mapping[str, Baseline]) -> None:
    """Refuses an unknown baseline, and one this command does not run by the command that does."""
    for name in compare:
        if name not in baselines and name in ELSEWHERE:
            raise UsageError(
                f"--compare {name}: needs torchrec, which this command does not import; "
                f"run {ELSEWHERE[name]} with the same arguments"
            )
    unknown = sorted(set(compare) - set(baselines))
    if unknown:
        raise UsageError(f"unknown baselines {unknown}; known: {sorted(baselines)}")


def _run(args: argparse.Namespace, baselines: Mapping[str, Baseline]) -> int:
    compare = [c for c in args.compare.split(",") if c]
    _check_baselines(compare, baselines)
    too_many = planned_world_size_refusal(args.world_size)
    if too_many is not None:
        raise UsageError(f"--world-size: {too_many}")
    check_output("--out", args.out)
    check_output("--plot", args.plot)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib (pip install 'embark-torchrec[plot]')")
    hardware = _load_hardware(args.hardware, args.hbm_gb)
    spec = _load_model(args.model)
    if args.batch_size is not None:
        spec = spec.with_batch_size(args.batch_size)
    topology = Topology(args.world_size, args.local_world_size, hardware)
    line = progress_line(None, f"planning {spec.name}")  # one line for every stage, on a terminal
    try:
        report = _plan_and_report(args, spec, topology, [(name, baselines[name]) for name in compare], line)
    finally:
        if line is not None:
            line.close()
    print(report)
    return 0


def _plan_and_report(
    args: argparse.Namespace,
    spec: ModelSpec,
    topology: Topology,
    compare: Sequence[tuple[str, Baseline]],
    line: ProgressLine | None,
) -> str:
    """Plans, bounds, compares with the (name, baseline) pairs in `compare`, writes the files asked for, and returns
    the report, with `line` (when drawn) showing each stage."""
    planned = plan_model(spec, topology, progress=line or False)
    cost = CostModel(spec, topology)
    plan = planned.plan.with_kinds(spec)  # the plan file says which tables are sequence tables
    plans = [ScoredPlan("embark", plan, planned.cost, planned.seconds, step_lower_bound(cost, progress=line))]
    for name, planner in compare:
        if line is not None:
            line(f"baseline {name}", 0, None)
        start = time.perf_counter()
        baseline = planner(spec, topology).with_kinds(spec)
        plans.append(ScoredPlan(name, baseline, cost.evaluate(baseline), time.perf_counter() - start))
    for scored in plans:
        check_finite(scored.name, scored.cost, scored.bound_ms, "no plan written")
    if line is not None:
        line("report", 0, None)
    if args.out:
        plan.save(args.out)
    if args.plot:
        plot_rank_loads(plans, args.plot)
    if args.json:
        result = {"model": spec.name, "world_size": topology.world_size, "plans": {p.name: summary(p) for p in plans}}
        return json.dumps(result, allow_nan=False)
    return render(plans, topology, spec.name) + (f"\n\nplan file written to {args.out}" if args.out else "")


def main(argv: Sequence[str] | None = None, baselines: Mapping[str, Baseline] = BASELINES, prog: str = PROG) -> int:
    """The CLI, comparing with `baselines` by name; returns the exit code: 0, or 2 after one line on stderr for a
    user error."""
    try:
        return _run(parse_args(argv, prog, baselines), baselines)
    except (UsageError, ValueError) as e:  # ValueError: SpecError, PlanError (FieldErrors), Topology's
        message = e
    except OSError as e:  # writing --out or --plot failed after all
        message = f"{e.filename}: {e.strerror}" if e.filename else e
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2
