"""Plan quality: EMBark's estimated step time against TWRW and TorchRec's default planner.

All three plans of a case are scored by the same CostModel.evaluate, so the speedups measure the
planners, not differences between cost models. How close EMBark's search comes to the best plan is
shown twice: against the same search with a 20x larger improvement budget (--long-factor), and
against a lower bound on any plan's step (bound.step_lower_bound). TorchRec's planner takes minutes on the large cases,
so it runs in a subprocess under a time limit, and every plan it finishes is cached in
benchmarks/cache/ (committed) so that the table regenerates in seconds.

    PYTHONPATH=. python benchmarks/plan_quality.py --out benchmarks/plan_quality.md
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterable

from embark_torchrec.plan.baselines import table_row_wise_plan
from embark_torchrec.plan.bound import step_lower_bound
from embark_torchrec.sharding.torchrec_plans import torchrec_default_plan
from embark_torchrec.plan.cost import CostModel
from embark_torchrec.plan.layout import Plan
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.search import SearchConfig
from embark_torchrec.plan.spec import ModelSpec, builtin_model
from embark_torchrec.plan.topology import DEFAULT_HARDWARE, PRESETS, Hardware, Topology

CACHE_DIR = Path(__file__).resolve().parent / "cache"
# Extra seconds the TorchRec subprocess gets to import torch and torchrec before its limit counts;
# a plan that still took longer than the limit is reported as timed out (but cached as finished).
IMPORT_GRACE_S = 30.0
SLOW_EMBARK_S = 60.0
LONG_FACTOR = 20  # the long search's improvement budget, in default budgets


@dataclass(frozen=True)
class Baseline:
    """What TorchRec's planner came to on one case: "ok" (with a plan), "failed", "timeout" or
    "crashed" (the process died without reporting: not cached, as it may not happen again)."""

    status: str
    seconds: float  # planning seconds; for "timeout", the limit it ran under
    plan: Plan | None = None
    reason: str = ""

    def to_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"status": self.status, "seconds": round(self.seconds, 2)}
        if self.reason:
            entry["reason"] = self.reason
        if self.plan is not None:
            entry["plan"] = self.plan.to_dict()
        return entry

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> "Baseline":
        plan = Plan.from_dict(entry["plan"]) if "plan" in entry else None
        return cls(entry["status"], float(entry["seconds"]), plan, entry.get("reason", ""))


@dataclass(frozen=True)
class Scored:
    """A plan's estimated step time and whether some rank is over the per-rank memory cap."""

    ms: float
    over_memory: bool


@dataclass(frozen=True)
class Case:
    model: str
    world_size: int
    embark: Scored | None  # None when embark's planner raised; embark_error says why
    embark_error: str
    embark_s: float
    long_search: Scored | None  # the same search with --long-factor times the improvement budget
    bound_ms: float
    twrw: Scored
    torchrec: Baseline
    torchrec_scored: Scored | None

    def speedup(self, baseline: Scored | None) -> float | None:
        return baseline.ms / self.embark.ms if baseline and self.embark else None

    def long_ratio(self) -> float | None:
        """embark's step over the long search's: how much a longer search would still gain."""
        return self.embark.ms / self.long_search.ms if self.embark and self.long_search else None


def short_reason(e: BaseException, width: int = 80) -> str:
    """The exception's type and first line, short enough for a table cell."""
    first = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= width else text[: width - 3] + "..."


# --- TorchRec's planner: a cached, time-limited subprocess ---------------------------------------


def case_key(spec: ModelSpec, topology: Topology) -> str:
    """Everything a TorchRec plan depends on: the model, the world and the hardware figures
    torchrec_topology hands its planner (not our cost model's others); a cache entry with another key is stale."""
    hw = topology.hardware
    inputs = {
        "spec": spec.to_dict(),
        "world_size": topology.world_size,
        "local_world_size": topology.local_world_size,
        "hbm_cap_bytes": topology.hbm_cap_bytes,
        "bandwidths_gbps": [hw.hbm_bw_gbps, hw.intra_node_bw_gbps, hw.inter_node_bw_gbps],
        "torchrec": version("torchrec"),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(model: str, topology: Topology) -> Path:
    t = topology
    return CACHE_DIR / f"torchrec_{model}_{t.world_size}x{t.local_world_size}_{t.hardware.name}.json"


def load_cached(path: Path, key: str, limit_s: float) -> Baseline | None:
    """The cached result as this limit would have seen it, or None when it must be recomputed."""
    if not path.exists():
        return None
    entry = json.loads(path.read_text())
    if entry.get("key") != key:
        return None
    if entry["status"] == "timeout":
        return Baseline("timeout", limit_s) if limit_s <= entry["limit_s"] else None
    if entry["seconds"] > limit_s:
        return Baseline("timeout", limit_s)
    return Baseline.from_entry(entry)


def save_cached(path: Path, key: str, limit_s: float, result: Baseline, context: dict[str, Any]) -> None:
    entry = {"key": key, "limit_s": limit_s, **context, **result.to_entry()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def run_torchrec(spec: ModelSpec, topology: Topology, limit_s: float) -> Baseline:
    """TorchRec's planner in a child process (this script, --torchrec-worker), killed at the limit."""
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(
            json.dumps(
                {
                    "spec": spec.to_dict(),
                    "world_size": topology.world_size,
                    "local_world_size": topology.local_world_size,
                    "hardware": dataclasses.asdict(topology.hardware),
                    "out": str(result),
                }
            )
        )
        cmd = [sys.executable, str(Path(__file__).resolve()), "--torchrec-worker", str(request)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=limit_s + IMPORT_GRACE_S)
        except subprocess.TimeoutExpired:
            return Baseline("timeout", limit_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if result.exists():
            return Baseline.from_entry(json.loads(result.read_text()))
        last = (err.strip().splitlines() or ["no output"])[-1]
        return Baseline("crashed", time.perf_counter() - start, reason=f"exit {proc.returncode}: {last[:60]}")


def torchrec_worker(request_path: str) -> None:
    """Child side of run_torchrec: plan, and write the result (or the failure) where asked."""
    import torchrec.distributed.planner  # noqa: F401  imported before the clock starts

    req = json.loads(Path(request_path).read_text())
    spec = ModelSpec.from_dict(req["spec"])
    topology = Topology(req["world_size"], req["local_world_size"], Hardware(**req["hardware"]))
    start = time.perf_counter()
    try:
        result = Baseline("ok", 0.0, torchrec_default_plan(spec, topology))
    except Exception as e:  # noqa: BLE001  any planner failure is a result to report
        result = Baseline("failed", 0.0, reason=short_reason(e))
    result = dataclasses.replace(result, seconds=time.perf_counter() - start)
    Path(req["out"]).write_text(json.dumps(result.to_entry()))


def torchrec_baseline(
    model: str, spec: ModelSpec, topology: Topology, limit_s: float, refresh: bool
) -> tuple[Baseline, bool]:
    """The cached result when valid for this limit, else a fresh run (cached). Also: was it cached."""
    path, key = cache_path(model, topology), case_key(spec, topology)
    cached = None if refresh else load_cached(path, key, limit_s)
    if cached is not None:
        return cached, True
    print(
        f"  running TorchRec's planner for {model} at {topology.world_size} GPUs (limit {limit_s:g} s)...",
        file=sys.stderr,
    )
    result = run_torchrec(spec, topology, limit_s)
    if result.status != "crashed":
        context = {"model": model, "batch_size": spec.batch_size, "torchrec": version("torchrec")}
        save_cached(path, key, limit_s, result, context)
        if result.seconds > limit_s:
            result = Baseline("timeout", limit_s)
    return result, False


# --- the cases and the table -----------------------------------------------------------------------


def run_case(model: str, world_size: int, args: argparse.Namespace) -> Case:
    spec = builtin_model(model).with_batch_size(args.batch_size)
    topology = Topology(world_size, args.local_world_size, PRESETS[args.hardware])
    cost = CostModel(spec, topology)

    def scored(plan: Plan) -> Scored:
        plan.validate(spec)
        step = cost.evaluate(plan)
        return Scored(step.step_ms, bool(step.rank_memory.max() > topology.hbm_cap_bytes))

    start, embark, embark_error = time.perf_counter(), None, ""
    try:
        embark = scored(plan_model(spec, topology).plan)
    except ValueError as e:  # PlanError, e.g. the model does not fit: a row to report, not a crash
        embark_error = short_reason(e)
    embark_s = time.perf_counter() - start
    if embark_s > SLOW_EMBARK_S:
        print(f"  note: embark took {embark_s:.0f} s to plan {model} at {world_size} GPUs", file=sys.stderr)
    long_search = None
    if embark is not None and args.long_factor > 0:
        budget = args.long_factor * SearchConfig().improve_evaluations
        long_search = scored(plan_model(spec, topology, config=SearchConfig(improve_evaluations=budget)).plan)
    twrw = scored(table_row_wise_plan(spec, topology))
    baseline, cached = torchrec_baseline(model, spec, topology, args.torchrec_limit_s, args.refresh)
    case = Case(
        model,
        world_size,
        embark,
        embark_error,
        embark_s,
        long_search,
        step_lower_bound(cost),
        twrw,
        baseline,
        scored(baseline.plan) if baseline.plan is not None else None,
    )
    print(
        f"done {model} at {world_size} GPUs: "
        + ", ".join(f"{k} {v}" for k, v in row(case, args).items() if k not in ("model", "GPUs"))
        + (" [TorchRec from cache]" if cached else ""),
        file=sys.stderr,
    )
    return case


def fmt_ms(s: Scored | None) -> str:
    return "" if s is None else f"{s.ms:.2f}" + (" (over memory)" if s.over_memory else "")


def fmt_speedup(case: Case, baseline: Scored | None) -> str:
    x = case.speedup(baseline)
    return "n/a" if x is None else f"{x:.2f}x" + ("*" if baseline.over_memory else "")


def row(case: Case, args: argparse.Namespace) -> dict[str, str]:
    tr = case.torchrec
    torchrec_ms = {
        "ok": fmt_ms(case.torchrec_scored),
        "timeout": "n/a",
        "failed": f"failed: {tr.reason}",
        "crashed": f"crashed: {tr.reason}",
    }[tr.status]
    torchrec_s = f"> {args.torchrec_limit_s:g} s" if tr.status == "timeout" else f"{tr.seconds:.1f}"
    return {
        "model": case.model,
        "GPUs": str(case.world_size),
        "embark ms": fmt_ms(case.embark) or f"failed: {case.embark_error}",
        "long search ms": fmt_ms(case.long_search) or "n/a",
        "embark / long search": "n/a" if case.long_ratio() is None else f"{case.long_ratio():.3f}",
        "bound ms": f"{case.bound_ms:.2f}",
        "TWRW ms": fmt_ms(case.twrw),
        "TorchRec ms": torchrec_ms,
        "speedup vs TWRW": fmt_speedup(case, case.twrw),
        "speedup vs TorchRec": fmt_speedup(case, case.torchrec_scored),
        "embark plan s": f"{case.embark_s:.1f}",
        "TorchRec plan s": torchrec_s,
    }


def geomean_speedup(cases: list[Case], pick: str) -> tuple[float | None, int]:
    """Geometric mean of embark's speedup over the cases whose baseline plan exists and fits."""
    xs = [c.speedup(b) for c in cases if (b := getattr(c, pick)) is not None and not b.over_memory]
    return (math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None), len(xs)


def command(args: argparse.Namespace) -> str:
    argv = [
        "python",
        "benchmarks/plan_quality.py",
        "--models",
        ",".join(args.models),
        "--world-sizes",
        ",".join(map(str, args.world_sizes)),
        "--local-world-size",
        str(args.local_world_size),
        "--batch-size",
        str(args.batch_size),
        "--hardware",
        args.hardware,
        "--torchrec-limit-s",
        f"{args.torchrec_limit_s:g}",
    ] + (["--long-factor", str(args.long_factor)] if args.long_factor != LONG_FACTOR else [])
    return "PYTHONPATH=. " + shlex.join(argv + (["--out", args.out] if args.out else []))


def markdown(cases: list[Case], args: argparse.Namespace) -> str:
    rows = [row(c, args) for c in cases]
    header = list(rows[0]) if rows else []
    lines = [
        f"Estimated step time (ms) of each plan, all scored by embark's CostModel: hardware {args.hardware}, "
        f"global batch {args.batch_size}, {args.local_world_size} GPUs per node; TorchRec's planner limited to "
        f"{args.torchrec_limit_s:g} s per case. Speedup = baseline ms / embark ms. Long search: embark's search "
        f"with {args.long_factor}x the improvement budget (SearchConfig.improve_evaluations); bound: no plan's "
        "step under the cost model is below it (bound.step_lower_bound).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(v.replace("|", "\\|") for v in r.values()) + " |" for r in rows),
        "",
    ]
    means = []
    for name, pick in (("TWRW", "twrw"), ("TorchRec", "torchrec_scored")):
        g, n = geomean_speedup(cases, pick)
        means.append(f"{g:.2f}x vs {name} ({n} of {len(cases)} cases)" if g else f"n/a vs {name}")
    large = [c.speedup(c.twrw) for c in cases if c.world_size >= 64 and c.twrw is not None and c.speedup(c.twrw)]
    if large:
        means.append(f"mean {sum(large) / len(large):.2f}x vs TWRW at 64+ GPUs ({len(large)} cases)")
    lines += [
        "Geometric-mean speedup of embark: " + ", ".join(means) + ". "
        "(over memory): some rank needs more than the per-rank cap; * marks a speedup against such a plan, "
        "left out of the geometric mean.",
        "",
        *long_search_summary(cases),
        f"Reproduce: `{command(args)}`",
    ]
    return "\n".join(lines) + "\n"


def long_search_summary(cases: list[Case]) -> list[str]:
    """The worst case of embark against its long search, and the geometric mean over the bound."""
    ratios = [(r, c) for c in cases if (r := c.long_ratio()) is not None]
    if not ratios:
        return []
    worst, case = max(ratios, key=lambda rc: rc[0])
    over_bound = [c.embark.ms / c.bound_ms for c in cases if c.embark and c.bound_ms > 0]
    mean = math.exp(sum(map(math.log, over_bound)) / len(over_bound))
    return [
        f"Embark within {worst:.3f}x of its long search on every case (worst: {case.model} at {case.world_size} "
        f"GPUs); {mean:.2f}x the lower bound (geometric mean).",
        "",
    ]


def as_json(cases: list[Case], args: argparse.Namespace) -> str:
    def scored(s: Scored | None) -> dict[str, Any] | None:
        return dataclasses.asdict(s) if s else None

    out = [
        {
            "model": c.model,
            "world_size": c.world_size,
            "embark": scored(c.embark),
            "embark_error": c.embark_error,
            "embark_plan_s": c.embark_s,
            "long_search": scored(c.long_search),
            "embark_over_long_search": c.long_ratio(),
            "bound_ms": c.bound_ms,
            "twrw": scored(c.twrw),
            "torchrec": scored(c.torchrec_scored),
            "torchrec_status": c.torchrec.status,
            "torchrec_plan_s": c.torchrec.seconds,
            "torchrec_reason": c.torchrec.reason,
            "speedup_vs_twrw": c.speedup(c.twrw),
            "speedup_vs_torchrec": c.speedup(c.torchrec_scored),
        }
        for c in cases
    ]
    return json.dumps({"command": command(args), "cases": out}, indent=1)


def csv_list(kind: type) -> Any:
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=csv_list(str), default=["dcnv2", "t180", "t200", "t510"])
    p.add_argument("--world-sizes", type=csv_list(int), default=[8, 16, 64, 128])
    p.add_argument("--local-world-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=65536, help="global batch")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, choices=sorted(PRESETS))
    p.add_argument("--torchrec-limit-s", type=float, default=300.0, help="per-case limit on TorchRec's planner")
    p.add_argument(
        "--long-factor", type=int, default=LONG_FACTOR, help="the long search's budget in default budgets; 0: none"
    )
    p.add_argument("--refresh", action="store_true", help="rerun TorchRec's planner even when cached")
    p.add_argument("--out", help="also write the markdown table to this file")
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    p.add_argument("--torchrec-worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Iterable[str] | None = None) -> None:
    args = parse_args(argv)
    if args.torchrec_worker:
        return torchrec_worker(args.torchrec_worker)
    cases = [run_case(m, ws, args) for m in args.models for ws in args.world_sizes]
    table = markdown(cases, args)
    if args.out:
        Path(args.out).write_text(table)
    print(as_json(cases, args) if args.json else table)


if __name__ == "__main__":
    main()
