"""Plan quality: EMBark's estimated step time against an independent search, TWRW and TorchRec's default planner.

Every plan of a case is scored by the same CostModel.evaluate, so the ratios measure the planners,
not differences between cost models. How close EMBark's greedy search comes to the best plan is
shown against the yardstick (benchmarks/yardstick.py: simulated annealing over whole-table re-cuts,
node confinement, cluster and group changes and cell moves, from the greedy's plan, TWRW, TorchRec's
plan and a random one; it shares only the cost model with the planner) and against a lower bound on
any plan's step (bound.step_lower_bound). Per plan, the busiest rank's embedding communication over
the average rank's is reported too. EMBark's plan is plan_model's with TorchRec's plan (where its
planner finished) as a candidate, as EmbarkPlanner gives it, so it is never behind TorchRec's or
TWRW's. The cases are the public models (dcnv2, t180, t200, t510) and
adversarial ones (benchmarks/models/, written by make_adversarial.py); a case is MODEL@W or
MODEL@WxL (L GPUs per node; default --local-world-size), its global batch --batch-size rounded down
to a multiple of W. TorchRec's planner takes minutes on the large cases, so it runs in a subprocess
under a time limit, and every plan it finishes is cached in benchmarks/cache/ (committed).

    PYTHONPATH=. python benchmarks/plan_quality.py --out benchmarks/plan_quality.md

The yardstick takes most of the run (about 40 minutes over the default cases): --no-yardstick plans
and scores everything else and takes the yardstick's step per case from a recorded run
(--recorded-yardstick, benchmarks/cache/yardstick_recorded.json), so the greedy can be measured
against it after a change to the search.
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

from embark_torchrec.plan.search.baselines import table_row_wise_plan
from embark_torchrec.plan.search.balance import comm_imbalance
from embark_torchrec.plan.cost.bound import step_lower_bound
from embark_torchrec.planner.torchrec_plans import torchrec_default_plan
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.tables import Plan
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.model.spec import ModelSpec, builtin_model, load_model_spec
from embark_torchrec.plan.model.topology import DEFAULT_HARDWARE, PRESETS, Hardware, Topology
from yardstick import Yardstick, YardstickConfig, YardstickResult, plan_differences

BENCHMARKS = Path(__file__).resolve().parent
CACHE_DIR = BENCHMARKS / "cache"
MODELS_DIR = BENCHMARKS / "models"
PUBLIC = ("dcnv2", "t180", "t200", "t510")
ADVERSARIAL = ("skewed_dcnv2@24", "skewed_dcnv2@128", "tiny_big@16x4", "tiny_big@64", "mixed300@32", "mixed300@96")
DEFAULT_CASES = tuple(f"{m}@{w}" for m in PUBLIC for w in (64, 128)) + ADVERSARIAL
# Extra seconds the TorchRec subprocess gets to import torch and torchrec before its limit counts;
# a plan that still took longer than the limit is reported as timed out (but cached as finished).
IMPORT_GRACE_S = 30.0
SLOW_EMBARK_S = 60.0
YARDSTICK_EVALUATIONS = 30000
RECORDED_YARDSTICK = CACHE_DIR / "yardstick_recorded.json"


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
    """A plan's estimated step time, whether some rank is over the per-rank memory cap, and the
    busiest rank's embedding communication over the average rank's (balance.comm_imbalance)."""

    ms: float
    over_memory: bool
    comm_ratio: float


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


@dataclass(frozen=True)
class CaseSpec:
    """MODEL@W or MODEL@WxL: a model (built-in, or benchmarks/models/MODEL.json) on W GPUs in nodes of L."""

    model: str
    world_size: int
    local_world_size: int

    @classmethod
    def parse(cls, text: str, local_world_size: int) -> "CaseSpec":
        model, at, world = text.partition("@")
        ws, x, lws = world.partition("x")
        if not at or not model or not ws.isdigit() or (x and not lws.isdigit()):
            raise argparse.ArgumentTypeError(f"case {text!r}: expected MODEL@W or MODEL@WxL, e.g. tiny_big@16x4")
        case = cls(model, int(ws), int(lws) if x else local_world_size)
        if case.world_size % case.local_world_size:
            raise argparse.ArgumentTypeError(f"case {text!r}: {case.local_world_size} GPUs per node do not divide {ws}")
        return case

    def __str__(self) -> str:
        return f"{self.model}@{self.world_size}x{self.local_world_size}"

    def spec(self, batch_size: int) -> ModelSpec:
        """The model with the global batch rounded down to a multiple of the world size."""
        path = MODELS_DIR / f"{self.model}.json"
        spec = load_model_spec(path) if path.exists() else builtin_model(self.model)
        return spec.with_batch_size(batch_size // self.world_size * self.world_size)


@dataclass(frozen=True)
class Case:
    case: CaseSpec
    batch_size: int
    embark: Scored | None  # None when embark's planner raised; embark_error says why
    embark_error: str
    embark_s: float
    yardstick: Scored | None  # None when embark's planner raised (its plan is a seed)
    yardstick_s: float
    yardstick_result: YardstickResult | None
    differences: tuple[str, ...]  # where the yardstick's plan differs from embark's, heaviest first
    bound_ms: float
    twrw: Scored
    torchrec: Baseline
    torchrec_scored: Scored | None

    def speedup(self, baseline: Scored | None) -> float | None:
        return baseline.ms / self.embark.ms if baseline and self.embark else None

    def yardstick_ratio(self) -> float | None:
        """embark's step over the yardstick's: how much better a plan the cost model admits."""
        return self.embark.ms / self.yardstick.ms if self.embark and self.yardstick else None


def run_case(case: CaseSpec, args: argparse.Namespace) -> Case:
    spec = case.spec(args.batch_size)
    topology = Topology(case.world_size, case.local_world_size, PRESETS[args.hardware])
    cost = CostModel(spec, topology)

    def scored(plan: Plan) -> Scored:
        plan.validate(spec)
        step = cost.evaluate(plan)
        return Scored(step.step_ms, bool(step.rank_memory.max() > topology.hbm_cap_bytes), comm_imbalance(step))

    baseline, cached = torchrec_baseline(case.model, spec, topology, args.torchrec_limit_s, args.refresh)
    candidates = {"torchrec": baseline.plan} if baseline.plan is not None else {}
    start, embark_plan, embark, embark_error = time.perf_counter(), None, None, ""
    try:
        embark_plan = plan_model(spec, topology, progress=False, candidates=candidates).plan
        embark = scored(embark_plan)
    except ValueError as e:  # PlanError, e.g. the model does not fit: a row to report, not a crash
        embark_error = short_reason(e)
    embark_s = time.perf_counter() - start
    if embark_s > SLOW_EMBARK_S:
        print(f"  note: embark took {embark_s:.0f} s to plan {case}", file=sys.stderr)
    twrw_plan = table_row_wise_plan(spec, topology)
    yard, yard_s, differences, yard_scored = None, 0.0, (), None
    if args.no_yardstick:
        yard_scored, yard_s = recorded_yardstick(args.recorded_yardstick, case)
    elif embark_plan is not None:
        config = YardstickConfig(evaluations=args.yardstick_evaluations, seed=args.yardstick_seed)
        seeds = {"embark": embark_plan, "TWRW": twrw_plan, "TorchRec": baseline.plan}
        yard = Yardstick(cost, config).run(seeds)
        yard_s = yard.seconds
        yard_scored = scored(yard.plan)
        differences = tuple(plan_differences(cost, embark_plan, yard.plan))
    result = Case(
        case,
        spec.batch_size,
        embark,
        embark_error,
        embark_s,
        yard_scored,
        yard_s,
        yard,
        differences,
        step_lower_bound(cost),
        scored(twrw_plan),
        baseline,
        scored(baseline.plan) if baseline.plan is not None else None,
    )
    print(
        f"done {case}: "
        + ", ".join(f"{k} {v}" for k, v in row(result, args).items() if k not in ("model", "GPUs"))
        + (" [TorchRec from cache]" if cached else ""),
        file=sys.stderr,
    )
    return result


def recorded_yardstick(path: Path, case: CaseSpec) -> tuple[Scored | None, float]:
    """The yardstick's best plan's step, communication ratio and seconds on this case in a recorded
    run (None when the file has no entry for it)."""
    entry = json.loads(path.read_text())["cases"].get(str(case))
    if entry is None:
        return None, 0.0
    return Scored(float(entry["ms"]), False, float(entry["comm_ratio"])), float(entry["seconds"])


def fmt_ms(s: Scored | None) -> str:
    return "" if s is None else f"{s.ms:.3f}" + (" (over memory)" if s.over_memory else "")


def fmt_speedup(case: Case, baseline: Scored | None) -> str:
    x = case.speedup(baseline)
    return "n/a" if x is None else f"{x:.2f}x" + ("*" if baseline.over_memory else "")


def fmt_comm(s: Scored | None) -> str:
    return "n/a" if s is None else f"{s.comm_ratio:.2f}"


def row(case: Case, args: argparse.Namespace) -> dict[str, str]:
    tr = case.torchrec
    torchrec_ms = {
        "ok": fmt_ms(case.torchrec_scored),
        "timeout": "n/a",
        "failed": f"failed: {tr.reason}",
        "crashed": f"crashed: {tr.reason}",
    }[tr.status]
    torchrec_s = f"> {args.torchrec_limit_s:g} s" if tr.status == "timeout" else f"{tr.seconds:.1f}"
    ratio = case.yardstick_ratio()
    c = case.case
    return {
        "model": c.model,
        "GPUs": f"{c.world_size} ({c.local_world_size}/node)",
        "embark ms": fmt_ms(case.embark) or f"failed: {case.embark_error}",
        "yardstick ms": fmt_ms(case.yardstick) or "n/a",
        "embark / yardstick": "n/a" if ratio is None else f"{ratio:.3f}",
        "bound ms": f"{case.bound_ms:.3f}",
        "TWRW ms": fmt_ms(case.twrw),
        "TorchRec ms": torchrec_ms,
        "vs TWRW": fmt_speedup(case, case.twrw),
        "vs TorchRec": fmt_speedup(case, case.torchrec_scored),
        "comm max/avg: embark": fmt_comm(case.embark),
        "yardstick": fmt_comm(case.yardstick),
        "TWRW": fmt_comm(case.twrw),
        "TorchRec": fmt_comm(case.torchrec_scored),
        "embark s": f"{case.embark_s:.1f}",
        "yardstick s": f"{case.yardstick_s:.0f}",
        "TorchRec s": torchrec_s,
    }


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def geomean_speedup(cases: list[Case], pick: str) -> tuple[float | None, int]:
    """Geometric mean of embark's speedup over the cases whose baseline plan exists and fits."""
    xs = [c.speedup(b) for c in cases if (b := getattr(c, pick)) is not None and not b.over_memory and c.embark]
    return geomean(xs), len(xs)


def command(args: argparse.Namespace) -> str:
    argv = [
        "python",
        "benchmarks/plan_quality.py",
        "--cases",
        ",".join(args.case_names),
        "--local-world-size",
        str(args.local_world_size),
        "--batch-size",
        str(args.batch_size),
        "--hardware",
        args.hardware,
        "--torchrec-limit-s",
        f"{args.torchrec_limit_s:g}",
    ]
    if args.no_yardstick:
        argv += ["--no-yardstick", "--recorded-yardstick", os.path.relpath(args.recorded_yardstick)]
    else:
        argv += ["--yardstick-evaluations", str(args.yardstick_evaluations)]
        argv += ["--yardstick-seed", str(args.yardstick_seed)]
    return "PYTHONPATH=. " + shlex.join(argv + (["--out", args.out] if args.out else []))


def acceptance(cases: list[Case]) -> list[str]:
    """Issue 26's acceptance, criterion by criterion, with the cases that miss it."""
    ratios = [(r, c) for c in cases if (r := c.yardstick_ratio()) is not None]
    lines = []
    if ratios:
        worst, wc = max(ratios, key=lambda rc: rc[0])
        mean = sum(r for r, _ in ratios) / len(ratios)
        over = [str(c.case) for r, c in ratios if r > 1.03]
        lines.append(
            f"- embark / yardstick <= 1.03 on every case: worst {worst:.3f} ({wc.case}), "
            + (f"over on {len(over)} of {len(ratios)}: {', '.join(over)}" if over else "met")
            + f"; mean {mean:.3f} (<= 1.02: {'met' if mean <= 1.02 else 'not met'})."
        )
    for name, pick in (("TWRW", "twrw"), ("TorchRec", "torchrec_scored")):
        pairs = [(x, c) for c in cases if (x := c.speedup(getattr(c, pick))) is not None]
        behind = [f"{c.case} ({x:.2f}x)" for x, c in pairs if x < 1.0]
        lines.append(
            f"- embark >= 1.0x {name} ({len(pairs)} cases with a plan): "
            + (f"behind on {', '.join(behind)}" if behind else "met")
            + "."
        )
    adversarial = [c for c in cases if c.embark and (MODELS_DIR / f"{c.case.model}.json").exists()]
    if adversarial:
        over = [f"{c.case} ({c.embark.comm_ratio:.2f})" for c in adversarial if c.embark.comm_ratio > 1.10]
        lines.append(
            "- embark's busiest / average rank communication <= 1.10 on the adversarial models: "
            + (f"over on {', '.join(over)}" if over else "met")
            + "."
        )
    return lines


def where_yardstick_wins(cases: list[Case]) -> list[str]:
    """Per case where the yardstick's plan is faster: the step's parts of both plans and the tables
    whose layouts differ most."""
    lines = []
    for c in cases:
        ratio = c.yardstick_ratio()
        if ratio is None or ratio <= 1.0005 or c.yardstick_result is None:
            continue
        y = c.yardstick_result
        lines.append(f"- **{c.case}** ({ratio:.3f}x): " + "; ".join(c.differences[:1]))
        lines += [f"  - {d}" for d in c.differences[1:]]
        moves = ", ".join(f"{k} {n}" for k, n in sorted(y.improved.items(), key=lambda kv: -kv[1]))
        seeds = ", ".join(
            f"{s.name} {s.start_ms:.3f} -> {s.end_ms:.3f}" if s.start_ms is not None else f"{s.name}: {s.reason}"
            for s in y.seeds
        )
        lines.append(f"  - seeds (ms, start -> annealed): {seeds}; new-best moves: {moves}")
    return lines


def markdown(cases: list[Case], args: argparse.Namespace) -> str:
    rows = [row(c, args) for c in cases]
    header = list(rows[0]) if rows else []
    lines = [
        f"Estimated step time (ms) of each plan, all scored by embark's CostModel: hardware {args.hardware}, "
        f"global batch {args.batch_size} (rounded down to a multiple of the GPUs); TorchRec's planner limited to "
        f"{args.torchrec_limit_s:g} s per case; embark's plan is plan_model's with TorchRec's as a candidate "
        "(as EmbarkPlanner plans). vs X = X's ms / embark's ms. Yardstick: benchmarks/yardstick.py, simulated "
        "annealing priced by the same cost model, seeded with embark's plan, TWRW, TorchRec's (where it finished) "
        "and a random plan; "
        + (
            f"its step and seconds are a recorded run's ({args.recorded_yardstick.name}, whose note says how it was "
            "priced), not re-run here; "
            if args.no_yardstick
            else f"{args.yardstick_evaluations} priced candidates, seed {args.yardstick_seed}; "
        )
        + "bound: no plan's step under the cost model is below it (bound.step_lower_bound). comm max/avg: the busiest "
        "rank's embedding communication (intra + inter-node ms) over the average rank's. Public models: "
        f"{', '.join(PUBLIC)}; adversarial: benchmarks/models/ (make_adversarial.py).",
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
    over_bound = geomean([c.embark.ms / c.bound_ms for c in cases if c.embark and c.bound_ms > 0])
    yard_bound = geomean([c.yardstick.ms / c.bound_ms for c in cases if c.yardstick and c.bound_ms > 0])
    lines += [
        "Geometric-mean speedup of embark: " + ", ".join(means) + ". "
        "(over memory): some rank needs more than the per-rank cap; * marks a speedup against such a plan, "
        "left out of the geometric mean."
        + (
            f" Over the lower bound (geometric mean): embark {over_bound:.2f}x, the yardstick {yard_bound:.2f}x."
            if over_bound and yard_bound
            else ""
        ),
        "",
        "Issue 26's acceptance:",
        "",
        *acceptance(cases),
        "",
    ]
    wins = where_yardstick_wins(cases)
    if wins:
        lines += [
            "Where the yardstick's plan is faster (the step's parts, sharding groups, and the tables whose layouts "
            "differ, by their load on the ranks; a layout reads cluster rows x columns, hier(archical), the nodes "
            "and ranks its cells use):",
            "",
            *wins,
            "",
        ]
    lines.append(f"Reproduce: `{command(args)}`")
    return "\n".join(lines) + "\n"


def as_json(cases: list[Case], args: argparse.Namespace) -> str:
    def scored(s: Scored | None) -> dict[str, Any] | None:
        return dataclasses.asdict(s) if s else None

    out = [
        {
            "case": str(c.case),
            "batch_size": c.batch_size,
            "embark": scored(c.embark),
            "embark_error": c.embark_error,
            "embark_plan_s": c.embark_s,
            "yardstick": scored(c.yardstick),
            "yardstick_s": c.yardstick_s,
            "embark_over_yardstick": c.yardstick_ratio(),
            "yardstick_seeds": [dataclasses.asdict(s) for s in c.yardstick_result.seeds] if c.yardstick_result else [],
            "differences": list(c.differences),
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


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases", default=",".join(DEFAULT_CASES), help="MODEL@W or MODEL@WxL, comma-separated (see the docstring)"
    )
    p.add_argument("--local-world-size", type=int, default=8, help="GPUs per node of a case that names none")
    p.add_argument("--batch-size", type=int, default=65536, help="global batch")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, choices=sorted(PRESETS))
    p.add_argument("--torchrec-limit-s", type=float, default=300.0, help="per-case limit on TorchRec's planner")
    p.add_argument("--yardstick-evaluations", type=int, default=YARDSTICK_EVALUATIONS, help="its budget per case")
    p.add_argument("--yardstick-seed", type=int, default=0)
    p.add_argument(
        "--no-yardstick", action="store_true", help="skip the yardstick; take its step from --recorded-yardstick"
    )
    p.add_argument(
        "--recorded-yardstick",
        type=Path,
        default=RECORDED_YARDSTICK,
        help="a recorded yardstick run (JSON: a note, and per case its ms, comm_ratio and seconds)",
    )
    p.add_argument("--refresh", action="store_true", help="rerun TorchRec's planner even when cached")
    p.add_argument("--out", help="also write the markdown table to this file")
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    p.add_argument("--torchrec-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.case_names = [x for x in args.cases.split(",") if x]
    args.case_specs = [CaseSpec.parse(x, args.local_world_size) for x in args.case_names]
    return args


def main(argv: Iterable[str] | None = None) -> None:
    args = parse_args(argv)
    if args.torchrec_worker:
        return torchrec_worker(args.torchrec_worker)
    cases = [run_case(c, args) for c in args.case_specs]
    table = markdown(cases, args)
    if args.out:
        Path(args.out).write_text(table)
    print(as_json(cases, args) if args.json else table)


if __name__ == "__main__":
    main()
