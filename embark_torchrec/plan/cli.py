"""python -m embark_torchrec.plan MODEL --world-size W --local-world-size L [...]

Plans MODEL (a spec file, or a built-in name: dcnv2, t180, t200, t510), prints the report (or one
JSON object with --json), writes the plan file with --out, and compares with the baselines named
by --compare (trw, torchrec), all scored by the same cost model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from .baselines import table_row_wise_plan
from .layout import Plan
from .cost import CostModel
from .plan_model import plan_model
from .report import ScoredPlan, plot_rank_loads, render, summary
from .spec import ModelSpec, SpecError, builtin_model, load_model_spec
from .topology import DEFAULT_HARDWARE, PRESETS, Topology, hardware_preset


def _torchrec_default_plan(spec: ModelSpec, topology: Topology) -> Plan:
    """TorchRec's own planner's plan: the one comparison that needs torchrec, imported only when asked for."""
    from ..sharding.torchrec_plans import torchrec_default_plan

    return torchrec_default_plan(spec, topology)


BASELINES = {"trw": table_row_wise_plan, "torchrec": _torchrec_default_plan}


def _load_model(model: str) -> ModelSpec:
    return load_model_spec(model) if Path(model).exists() else builtin_model(model)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m embark_torchrec.plan", description=__doc__.split("\n\n")[1])
    p.add_argument("model", help="model spec file (JSON/YAML) or built-in model name")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--local-world-size", type=int, required=True)
    p.add_argument("--batch-size", type=int, help="global batch size (default: the spec's)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, choices=sorted(PRESETS))
    p.add_argument("--hbm-gb", type=float, help="override the preset's memory per GPU")
    p.add_argument("--out", type=Path, help="write the plan file here")
    p.add_argument("--compare", default="", help="comma-separated baselines: trw, torchrec")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--plot", type=Path, help="write a PNG of per-rank load for each plan")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    compare = [c for c in args.compare.split(",") if c]
    unknown = sorted(set(compare) - set(BASELINES))
    if unknown:
        print(f"error: unknown baselines {unknown}; known: {sorted(BASELINES)}", file=sys.stderr)
        return 2
    try:
        spec = _load_model(args.model)
    except (SpecError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.batch_size:
        spec = spec.with_batch_size(args.batch_size)
    hardware = hardware_preset(args.hardware).with_overrides(hbm_gb=args.hbm_gb)
    try:
        topology = Topology(args.world_size, args.local_world_size, hardware)
        planned = plan_model(spec, topology)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cost = CostModel(spec, topology)
    plans = [ScoredPlan("embark", planned.plan, planned.cost, planned.seconds)]
    for name in compare:
        start = time.perf_counter()
        baseline = BASELINES[name](spec, topology)
        plans.append(ScoredPlan(name, baseline, cost.evaluate(baseline), time.perf_counter() - start))
    if args.out:
        planned.plan.save(args.out)
    if args.plot:
        plot_rank_loads(plans, args.plot)
    if args.json:
        print(
            json.dumps(
                {"model": spec.name, "world_size": topology.world_size, "plans": {p.name: summary(p) for p in plans}}
            )
        )
    else:
        print(render(plans, topology, spec.name))
        if args.out:
            print(f"\nplan file written to {args.out}")
    return 0
