"""The sweep: fresh generated models (benchmarks/model_generator.py) end to end on an emulated cluster, each planned
by embark, by TorchRec's default planner given the calibrated topology ("torchrec"), by TorchRec's planner as a user
runs it, without a hardware file ("torchrec-user"), and table-row-wise ("trw"), in interleaved rounds; then the
distribution of measured speedups and of the cost model's errors, and the error on plan differences it implies.

Models we never tuned for are the test of the planner's claim: on a model where it predicts a gain the gain must be
measured, and where the gain is within the cost model's error it must keep TorchRec's plan. So each run draws new
seeds (printed, so that a result can be rerun with --seeds), one calibration of the cluster serves every model
(--hardware reuses one), each model's dense part is measured on the cluster before its rounds (the example's
--calibrate dense: seconds), and every plan that ran is priced again with that model's hardware file, so that the
predicted speedups and the measured ones are of the same plans on the same figures.

    PYTHONPATH=. .venv/bin/python benchmarks/sweep.py [--count 10 | --seeds 1,2,3] [--hardware FILE]
        [--nodes 2] [--gpus-per-node 2] [--link-mbit 50] [--rounds 2] [--steps 25] [--measured-seconds S]
        [--batch-size 2048]
        [--out benchmarks/sweep.md] [--write-error FILE]
    PYTHONPATH=. .venv/bin/python benchmarks/sweep.py --more 3 --out benchmarks/sweep.md  (fresh models added)

The error on plan differences (how far below and above its prediction embark's measured speedup over TorchRec's plans
fell, as fractions of the prediction) is the figure the planner needs to be honest (Hardware.plan_error_below and
plan_error_above): --write-error FILE writes the calibrated hardware file with it, for the planner to plan with
(benchmarks/plan_band.py pools several kept sweeps'). Needs root (network namespaces), ip and tc.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from embark_torchrec.calibrate import stats
from embark_torchrec.cluster import ClusterSpec
from embark_torchrec.plan import CostModel, ModelSpec, Plan, Topology, plan_model
from embark_torchrec.plan.model.topology import Hardware
from embark_torchrec.plan.model.hardware_file import load_hardware, save_hardware

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster_e2e import (  # noqa: E402 (next to this file)
    INTERRUPTS,
    Rounds,
    TIMEOUT_S,
    display,
    cluster_run,
    cluster_ready,
    run_flags,
    stop_if_interrupted,
    with_figures_of,
)
from e2e import calibrate, calibrate_dense, run_example  # noqa: E402
from model_generator import ModelRanges, describe, generate_model  # noqa: E402

OUT = ROOT / "benchmarks" / "sweep.md"
# TorchRec's DLRM (the example's model) trains no feature shared by tables (train.py says why)
RANGES = ModelRanges(shared_feature_share=0.0)
# run name -> (the example's --planner, whether it plans with the calibrated hardware file)
RUNS = {"embark": ("embark", True), "torchrec": ("torchrec", True), "torchrec-user": ("torchrec", False),
        "trw": ("trw", True)}  # fmt: skip
# (a, b): a's speedup over b, measured and predicted
PAIRS = (("embark", "torchrec"), ("embark", "torchrec-user"), ("embark", "trw"))
FLOOR = 0.98  # embark / TorchRec's planner, on every model
MEDIAN_TARGET = 1.10  # embark / TorchRec's planner, median over the models
TRW_TARGET = 1.5  # embark / trw, median over the models
ESTIMATE_TARGET = 0.15  # |estimated / measured step - 1|, every plan
SPEEDUP_TARGET = 0.07  # |predicted - measured| speedup of embark over torchrec, every model
MIN_MEASURED_STEPS = 8  # the fewest measured steps a run gets under --measured-seconds


@dataclass
class ModelOutcome(Rounds):
    """One generated model's rounds (every plan priced with the calibrated hardware): its seed and spec, whether
    embark's plan was TorchRec's, how long it took, and the hardware figures its plans were priced with (their
    error on plan differences, Hardware.speedup_band: the band its planner's report printed)."""

    seed: int
    spec: ModelSpec
    kept_torchrec: bool
    seconds: float
    figures: Hardware | None = None
    same_plans: frozenset[frozenset[str]] = field(default_factory=frozenset)  # pairs of runs of one plan

    def measured(self, a: str, b: str) -> float:
        """a's speedup over b; 1.0 where the two ran the same plan (table by table): one ShardingPlan runs the same
        program, so what its two runs measure apart is the box's spread (runs_apart), not a speedup."""
        return 1.0 if self.same_plan(a, b) else super().measured(a, b)

    def same_plan(self, a: str, b: str) -> bool:
        """Whether runs a and b ran one plan (priced found their plans' tables equal)."""
        return frozenset((a, b)) in self.same_plans

    def runs_apart(self, a: str, b: str) -> float:
        """What a's runs measured over b's (the median of per-round ratios), the same plan or not."""
        return super().measured(a, b)

    def band(self) -> tuple[float, float] | None:
        """The band the planner's report printed around embark's predicted speedup over torchrec; None: unmeasured."""
        return None if self.figures is None else self.figures.speedup_band(self.predicted("embark", "torchrec"))

    def within_band(self) -> bool:
        """Whether embark's measured speedup over torchrec lies in the band the planner's report printed."""
        band = self.band()
        return band is not None and band[0] <= self.measured("embark", "torchrec") <= band[1]


def measure(args: argparse.Namespace, seed: int, cluster: Path, tmp: Path) -> ModelOutcome:
    """One model's interleaved rounds of every run. The cluster's figures get this model's dense part measured on
    the cluster first (every plan runs it alike, but its compute and its all-reduce are a share of every step); the
    spec, that hardware file, the plans and the rounds are kept in the model's folder (model_folder), so that
    --reprice prices them again."""
    start = time.perf_counter()
    spec = generate_model(seed, RANGES)
    folder = model_folder(args.out, seed)
    folder.mkdir(parents=True, exist_ok=True)
    spec_file = folder / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    dense_run = cluster_run(args, str(spec_file), args.nodes, args.link_mbit[0], cluster, tmp / "unused.md")
    (folder / "hardware.json").write_text(calibrate_dense(dense_run, tmp, f"{spec.name}_dense").read_text())
    return run_rounds(args, seed, folder, tmp, start, planned=False)


def model_steps(args: argparse.Namespace, folder: Path) -> int:
    """The example's --steps for every run of one model: --steps, or with --measured-seconds S as many as measure S
    seconds at embark's estimated step for the model (its folder's plan priced, else the model planned with its
    hardware file), after the warm-up and the pipeline's last step: at least MIN_MEASURED_STEPS measured and at most
    --steps in all. At a fixed count the sweep's length is the drawn models' (sweep 11's models of 2.5-4 s steps took
    13-19 minutes each, against 6 at 0.75 s), and a plan's runs spread between rounds about as much at 11 measured
    steps as at 19 (sweeps 4-9 against 10): the drift between runs, not the count, sets most of it."""
    if args.measured_seconds is None:
        return args.steps
    shape = {"world_size": args.nodes * args.gpus_per_node, "local_world_size": args.gpus_per_node}
    cost = kept_cost(folder, kept_spec(folder), shape | {"batch_size": args.batch_size})
    kept = folder / "embark.plan.json"
    plan = Plan.load(kept) if kept.exists() else plan_model(cost.spec, cost.topology).plan
    step_ms = cost.evaluate(plan).step_ms
    measured = max(MIN_MEASURED_STEPS, math.ceil(args.measured_seconds * 1e3 / step_ms))
    return min(args.steps, args.warmup_steps + 1 + measured)


def run_rounds(
    args: argparse.Namespace, seed: int, folder: Path, tmp: Path, start: float, planned: bool
) -> ModelOutcome:
    """A model's interleaved rounds of every run, from its folder's spec and hardware file, kept as its rounds.json:
    each run plans (its plan kept in the folder) or, `planned`, runs the folder's plan (--remeasure)."""
    runs = interleaved_rounds(args, seed, folder, tmp, list(RUNS), planned)
    ws = args.nodes * args.gpus_per_node
    rounds = {"seed": seed, "world_size": ws, "local_world_size": args.gpus_per_node, "batch_size": args.batch_size}
    rounds |= {"seconds": time.perf_counter() - start, "runs": runs}
    (folder / "rounds.json").write_text(json.dumps(rounds, indent=1))
    return priced(folder)


def interleaved_rounds(
    args: argparse.Namespace,
    seed: int,
    folder: Path,
    tmp: Path,
    names: list[str],
    planned: bool,
    planners: Mapping[str, tuple[str, bool]] = RUNS,
    flags: Callable[[str, int], Sequence[str]] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """args.rounds rounds of the runs `names` (of `planners`: a run's planner and whether it is given the folder's
    hardware file) of a model's folder, every other round in reverse, each run's RESULT by run (its steps among
    them: model_steps'): each run plans (its plan kept in the folder) or, `planned`, runs the folder's
    <run>.plan.json. `flags(run, round)`: more of the example's flags for one run (step_stages.py's --stage-times)."""
    args = argparse.Namespace(**vars(args) | {"steps": model_steps(args, folder)})
    runs: dict[str, list[dict[str, Any]]] = {run: [] for run in names}
    for i in range(args.rounds):
        for run in names if i % 2 == 0 else names[::-1]:
            stop_if_interrupted()
            planner, with_hardware = planners[run]
            hardware = folder / "hardware.json" if with_hardware else None
            once = cluster_run(args, str(folder / "spec.json"), args.nodes, args.link_mbit[0], hardware, tmp / "u.md")
            plan = folder / f"{run}.plan.json"
            out, given = (tmp / "unused.plan.json", plan) if planned else (plan, None)
            extra = (*run_flags(args), *(flags(run, i) if flags else ()))
            result = run_example(planner, once, out, given, extra=extra)
            runs[run].append(result)
            print(
                f"seed {seed} round {i + 1}/{args.rounds} {run}: {result['samples_per_s']:,.0f} samples/s, "
                f"{result['inter_node_bytes_per_step']:,} inter-node bytes/step",
                flush=True,
            )
    return runs


def remeasure(args: argparse.Namespace, tmp: Path) -> list[ModelOutcome]:
    """--remeasure FROM: the models FROM's sweep kept (each folder's spec, hardware file and plans, copied into
    --out's folder) run again in fresh rounds with today's runtime and measurement, their plans not planned again:
    how today's cost model prices plans it did not choose, on rounds it was not fitted to."""
    source = args.remeasure.with_suffix("")
    outcomes = []
    for seed in kept_seeds(source):
        start, folder = time.perf_counter(), model_folder(args.out, seed)
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("spec.json", "hardware.json", *(f"{run}.plan.json" for run in RUNS)):
            (folder / name).write_text((source / f"seed{seed}" / name).read_text())
        save_hardware(folder / "hardware.json", with_dense_of(args.hardware, folder / "hardware.json"))
        outcomes.append(run_rounds(args, seed, folder, tmp, start, planned=True))
    return outcomes


def with_dense_of(cluster: Path, model: Path) -> dict[str, Any]:
    """The cluster's hardware file with a model's dense figures (its measured dense step and counted parameters, as
    `--calibrate dense` measured them on the same cluster): a model kept by an earlier sweep, priced with the
    cluster's figures calibrated since."""
    document, kept = with_figures_of(cluster, model, DENSE_FIELDS), json.loads(model.read_text())
    document["run"]["dense_date"] = kept["run"].get("dense_date", kept["run"]["date"])
    return document


def kept_seeds(folder: Path) -> list[int]:
    """The seeds of the models a sweep's folder holds measured rounds of."""
    return [int(f.name.removeprefix("seed")) for f in sorted(folder.glob("seed*")) if (f / "rounds.json").exists()]


def model_folder(out: Path, seed: int) -> Path:
    """Where a model's files and rounds are kept: benchmarks/sweep/seed<seed>/ for benchmarks/sweep.md."""
    return out.with_suffix("") / f"seed{seed}"


def kept_spec(folder: Path) -> ModelSpec:
    """A kept model's spec (its folder's spec.json), at the batch per rank it was generated with."""
    return ModelSpec.from_dict(json.loads((folder / "spec.json").read_text()))


def kept_cost(folder: Path, spec: ModelSpec, rounds: dict[str, Any]) -> CostModel:
    """Today's cost model of a kept model (`spec`, its folder's hardware.json) at the shape and global batch its
    rounds (rounds.json) ran at."""
    ws = rounds["world_size"]
    topology = Topology(ws, rounds["local_world_size"], load_hardware(folder / "hardware.json"))
    return CostModel(spec.with_batch_size(rounds["batch_size"] * ws), topology)


def priced(folder: Path) -> ModelOutcome:
    """A model's kept rounds, every plan priced with today's cost model and the model's hardware file."""
    rounds = json.loads((folder / "rounds.json").read_text())
    spec = kept_spec(folder)
    cost = kept_cost(folder, spec, rounds)
    plans = {run: Plan.load(folder / f"{run}.plan.json") for run in RUNS}
    estimated = {run: cost.evaluate(plan).step_ms for run, plan in plans.items()}
    same = frozenset(
        frozenset(pair) for pair in combinations(RUNS, 2) if plans[pair[0]].tables == plans[pair[1]].tables
    )
    # the planner's incumbent is the cheaper of TorchRec's plans on the calibrated figures and on the preset's (what
    # the user's run of TorchRec's planner, without a hardware file, makes): either returned is TorchRec's plan kept
    kept = any(frozenset(("embark", run)) in same for run in ("torchrec", "torchrec-user"))
    hardware = cost.topology.hardware
    return ModelOutcome(rounds["runs"], estimated, rounds["seed"], spec, kept, rounds["seconds"], hardware, same)


def speedup_misses(outcomes: list[ModelOutcome]) -> list[float]:
    """Per model, |predicted - measured| speedup of embark over torchrec."""
    return [abs(o.predicted("embark", "torchrec") - o.measured("embark", "torchrec")) for o in outcomes]


def plan_difference_error(outcomes: list[ModelOutcome]) -> float:
    """The largest miss over the models, in points of speedup (the acceptance's measure)."""
    return max(speedup_misses(outcomes))


def plan_differences(outcomes: list[ModelOutcome]) -> list[tuple[float, float]]:
    """Embark's predicted and measured speedup over each of TorchRec's plans (the calibrated and the user's) where the
    two ran different plans: every plan difference the sweep measured."""
    return [
        (o.predicted("embark", b), o.measured("embark", b))
        for o in outcomes
        for b in ("torchrec", "torchrec-user")
        if not o.same_plan("embark", b)
    ]


def speedup_ratios(outcomes: list[ModelOutcome]) -> list[float]:
    """Measured / predicted speedup of every plan difference (plan_differences): its miss as a fraction of it."""
    return [measured / predicted for predicted, measured in plan_differences(outcomes)]


def write_error(
    hardware: Path, out: Path, outcomes: list[ModelOutcome], where: str | None = None
) -> tuple[float, float]:
    """The calibrated hardware file with the measured error on plan differences (the band of `outcomes`' speedup
    ratios), marked measured, the ratios as its measurement; the band's (plan_error_below, plan_error_above)."""
    where = where or f"benchmarks/sweep.py seeds {[o.seed for o in outcomes]}"
    document = json.loads(hardware.read_text())
    below, above = set_plan_band(document, speedup_ratios(outcomes), where)
    save_hardware(out, document)
    print(f"wrote {out} with plan_error_below {below:.4f}, plan_error_above {above:.4f}")
    return below, above


def set_plan_band(document: dict[str, Any], ratios: list[float], where: str) -> tuple[float, float]:
    """A hardware document's error on plan differences set from `ratios` (measured / predicted speedup, each plan
    difference measured `where`): plan_error_below the largest shortfall (1 - ratio), plan_error_above the largest
    excess, each marked measured with the ratios as its measurement, and an absolute plan_error the file held removed
    (one error, one band); the pair set."""
    if not ratios:
        raise ValueError(f"no plan difference measured ({where}): every model ran TorchRec's plan")
    below = round(max(0.0, 1 - min(ratios)), 4)
    above = round(max(0.0, max(ratios) - 1), 4)
    for part in ("hardware", "sources", "measurements"):
        document.get(part, {}).pop("plan_error", None)
    measurement = stats(ratios, "ratio", f"measured / predicted speedup of embark over TorchRec's plans, {where}")
    for name, value in (("plan_error_below", below), ("plan_error_above", above)):
        document["hardware"][name] = value
        document.setdefault("sources", {})[name] = "measured"
        document.setdefault("measurements", {})[name] = measurement
    return below, above


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def summary(outcomes: list[ModelOutcome]) -> list[str]:
    """The acceptance lines over every model measured."""
    lines = []
    for b in ("torchrec", "torchrec-user"):
        got = [o.measured("embark", b) for o in outcomes]
        lines.append(
            f"- embark / {b}: min {min(got):.2f}x, median {statistics.median(got):.2f}x, max {max(got):.2f}x; "
            f">= {FLOOR}x on every model {verdict(min(got) >= FLOOR)}, median >= {MEDIAN_TARGET}x "
            f"{verdict(statistics.median(got) >= MEDIAN_TARGET)}"
        )
    itself = [o.runs_apart(a, b) for o in outcomes for a, b in PAIRS if o.same_plan(a, b)]
    if itself:
        lines.append(
            f"- {len(itself)} of these comparisons are of a plan with itself (embark kept that TorchRec plan, table by "
            f"table), counted 1.00x: their runs measured {min(itself):.2f}-{max(itself):.2f}x apart, the box's spread"
        )
    trw = statistics.median(o.measured("embark", "trw") for o in outcomes)
    lines.append(f"- embark / trw: median {trw:.2f}x; >= {TRW_TARGET}x {verdict(trw >= TRW_TARGET)}")
    misses = [abs(o.estimate_error(run)) for o in outcomes for run in RUNS if run != "torchrec-user"]
    lines.append(
        f"- estimated / measured step (every plan priced with the calibrated file): worst {max(misses):.0%} off, "
        f"median {statistics.median(misses):.0%}; within {ESTIMATE_TARGET:.0%} "
        f"{verdict(max(misses) <= ESTIMATE_TARGET)}"
    )
    error = plan_difference_error(outcomes)
    lines.append(
        f"- predicted - measured speedup of embark over torchrec: worst {error:.3f}; within {SPEEDUP_TARGET} "
        f"{verdict(error <= SPEEDUP_TARGET)}"
    )
    kept = [o.seed for o in outcomes if o.kept_torchrec]
    lines.append(f"- TorchRec's plan kept on {len(kept)} of {len(outcomes)} models (seeds {kept or 'none'})")
    claimed = [o for o in outcomes if not o.kept_torchrec and o.band() is not None]
    if claimed:
        inside = sum(o.within_band() for o in claimed)
        lines.append(
            f"- where embark's plan ran, its measured speedup over torchrec lay within the band its report printed "
            f"(Hardware.speedup_band) on {inside} of {len(claimed)} models {verdict(inside == len(claimed))}"
        )
    return lines


def steps_a_run(args: argparse.Namespace, outcomes: list[ModelOutcome]) -> str:
    """The page's words for the steps the runs took: --steps, or under --measured-seconds the range the models got."""
    if args.measured_seconds is None:
        return f"{args.steps} steps a run"
    took = sorted({r["steps"] for o in outcomes for rounds in o.runs.values() for r in rounds})
    span = f"{took[0]}" if took[0] == took[-1] else f"{took[0]}-{took[-1]}"
    return (
        f"{span} steps a run (each model's: {args.measured_seconds:g} s of measured steps at embark's estimated step, "
        f"at least {MIN_MEASURED_STEPS} measured, at most {args.steps} in all)"
    )


def markdown(
    outcomes: list[ModelOutcome], args: argparse.Namespace, hardware: Path, seconds: float, note: str = ""
) -> str:
    ws = args.nodes * args.gpus_per_node
    window = "" if args.last_step_measured else " and the pipeline's last step"
    lines = [
        f"# The sweep: {len(outcomes)} generated models on {args.nodes} emulated nodes x {args.gpus_per_node} CPU "
        f"ranks at {args.link_mbit[0]:g} Mbit/s",
        "",
        f"Models from benchmarks/model_generator.py, seeds {', '.join(str(o.seed) for o in outcomes)}; batch "
        f"{args.batch_size} per rank ({args.batch_size * ws} global), {steps_a_run(args, outcomes)} "
        f"({args.warmup_steps} of warm-up{window} left out of samples/s), {args.rounds} "
        f"interleaved rounds of {', '.join(RUNS)}; planned with `{display(hardware)}` with each model's dense part "
        "measured on the cluster first (the example's --calibrate dense; torchrec-user: no hardware file); every plan "
        "priced again with that model's file. Speedups: measured, the median of per-round samples/s ratios (of "
        "a plan with itself: 1.00x, what its runs measured apart shown beside); predicted, the estimated steps' "
        f"ratio. {seconds / 60:.1f} min in all.",
        *(["", note] if note else []),
        "",
        "## Targets",
        "",
        *summary(outcomes),
        "",
        "## Models",
        "",
        "| seed | model | kept TorchRec's | "
        + " | ".join(f"{a} / {b} measured (predicted)" for a, b in PAIRS)
        + " | estimated / measured step |",
        "|---|---|---|" + "---:|" * len(PAIRS) + "---|",
    ]
    for o in outcomes:
        pairs = " | ".join(
            f"same plan (runs {o.runs_apart(a, b):.2f}x)" if o.same_plan(a, b) else
            f"{o.measured(a, b):.2f}x ({o.predicted(a, b):.2f}x)"
            for a, b in PAIRS
        )  # fmt: skip
        misses = ", ".join(f"{run} {o.estimate_error(run):+.0%}" for run in RUNS)
        lines.append(f"| {o.seed} | {describe(o.spec)} | {'yes' if o.kept_torchrec else 'no'} | {pairs} | {misses} |")
    seeds = ",".join(str(o.seed) for o in outcomes)
    measured_flag = "" if args.measured_seconds is None else f" --measured-seconds {args.measured_seconds:g}"
    lines += [
        "",
        f"Rerun these models: `PYTHONPATH=. .venv/bin/python benchmarks/sweep.py --seeds {seeds} --hardware "
        f"{display(hardware)} --nodes {args.nodes} --gpus-per-node {args.gpus_per_node} --link-mbit "
        f"{args.link_mbit[0]:g} --rounds {args.rounds} --steps {args.steps}{measured_flag} --warmup-steps "
        f"{args.warmup_steps} --batch-size {args.batch_size} --out {display(args.out)}`",
    ]
    return "\n".join(lines) + "\n"


def kept_model_flags(p: argparse.ArgumentParser, out: Path) -> None:
    """The flags of a benchmark that runs one kept model of a sweep again (plan_ablation.py, step_stages.py)."""
    p.add_argument("--sweep", type=Path, help="a kept sweep's markdown (its folder holds the models)")
    p.add_argument("--seed", type=int, help="the sweep's model to run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--kept", action="store_true", help="run nothing: the markdown from the kept models")


def check_kept_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """kept_model_flags' values, refused by name where --sweep keeps no such model; the sweep's settings (but its
    rounds) into `args`, for its runs to run as the sweep's did."""
    if args.sweep is None or args.seed is None:
        p.error("--sweep and --seed are needed (or --kept)")
    settings_file = args.sweep.with_suffix("") / "sweep.json"
    if not settings_file.exists():
        p.error(f"--sweep {args.sweep}: {settings_file} holds no kept sweep")
    if args.seed not in kept_seeds(args.sweep.with_suffix("")):
        p.error(f"--seed {args.seed}: not a model {args.sweep.with_suffix('')} kept rounds of")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    settings = json.loads(settings_file.read_text())
    vars(args).update({k: v for k, v in kept_settings(settings).items() if k != "rounds"})
    args.timeout_s = TIMEOUT_S


def kept_model_rounds(
    args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], seconds: float
) -> dict[str, Any]:
    """What a benchmark that ran one kept model again (plan_ablation.py, step_stages.py) keeps of its rounds, before
    its own fields: the model, the shape and batch its runs report, how long they took, and the runs."""
    first = next(iter(runs.values()))[0]
    return {
        "seed": args.seed,
        "sweep": display(args.sweep),
        "world_size": first["world_size"],
        "local_world_size": first["local_world_size"],
        "batch_size": first["batch_size"],
        "seconds": seconds,
        "runs": runs,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=10, help="models, each of a fresh random seed")
    p.add_argument("--seeds", default="", help="comma-separated seeds instead of fresh ones (to rerun a result)")
    p.add_argument("--hardware", type=Path, help="this cluster's calibrated hardware file (else calibrate once)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--link-mbit", default="50", help="each node's link, Mbit/s per direction")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=25, help="steps a run (with --measured-seconds, at most)")
    p.add_argument(
        "--measured-seconds",
        type=float,
        help="give each model's runs the steps that measure this many seconds at embark's estimated step (at least "
        f"{MIN_MEASURED_STEPS} measured, --steps at most): the sweep's length does not follow the drawn models'",
    )
    p.add_argument(
        "--warmup-steps", type=int, default=4, help="first steps of a run left out of samples/s (the example's flag)"
    )
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help="per run (the calibration job too)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument(
        "--write-error",
        type=Path,
        help="write the calibrated hardware file with the measured error on plan differences (its band)",
    )
    p.add_argument(
        "--reprice",
        action="store_true",
        help="run nothing: price the kept rounds of --out's models (its folder) again with today's cost model",
    )
    p.add_argument(
        "--remeasure",
        type=Path,
        help="instead of new models, run the plans of the models this sweep's markdown kept (its folder) again, in "
        "fresh rounds kept under --out's folder, each priced with --hardware (the cluster file) and the "
        "model's kept dense figures",
    )
    p.add_argument(
        "--more",
        type=int,
        default=0,
        help="add this many fresh models to --out's kept sweep (its settings and cluster file; its models priced "
        "from their kept rounds, not run again), and write the whole",
    )
    args = p.parse_args(argv)
    seeds_given = bool(args.seeds.strip())
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()] or [
            secrets.randbelow(2**31) for _ in range(args.count)
        ]
        args.link_mbit = [float(args.link_mbit)]
        ClusterSpec(nodes=args.nodes, gpus_per_node=args.gpus_per_node, link_mbit=args.link_mbit[0])
    except ValueError as e:
        p.error(f"--seeds / --link-mbit / --nodes / --gpus-per-node: {e}")
    if args.rounds < 1 or args.steps < 2 or args.batch_size < 1 or args.count < 1 or args.warmup_steps < 0:
        p.error("--count, --rounds, --batch-size must be >= 1, --steps >= 2 and --warmup-steps >= 0")
    if args.measured_seconds is not None and (
        args.measured_seconds <= 0 or args.steps < args.warmup_steps + 1 + MIN_MEASURED_STEPS
    ):
        p.error(
            f"--measured-seconds {args.measured_seconds:g}: expected > 0, with --steps at least --warmup-steps + 1 + "
            f"{MIN_MEASURED_STEPS} (the fewest measured steps it gives a run)"
        )
    if args.hardware is not None:
        load_hardware(args.hardware)  # a bad file fails here, before any run
    args.last_step_measured = False  # runs today leave it out (jobs.measured_window); --reprice reads the kept sweep's
    if args.remeasure is not None and (
        args.hardware is None or not (args.remeasure.with_suffix("") / "sweep.json").exists()
    ):
        p.error(f"--remeasure {args.remeasure}: needs a kept sweep (its folder's sweep.json) and --hardware")
    if args.more:
        if args.more < 0 or args.reprice or args.remeasure is not None or args.hardware is not None or seeds_given:
            p.error(
                "--more N: N >= 1, with neither --reprice, --remeasure, --hardware (the kept sweep's is used) nor "
                "--seeds (its models are fresh)"
            )
        settings_file = args.out.with_suffix("") / "sweep.json"
        if not settings_file.exists():
            p.error(f"--more: {settings_file} holds no kept sweep to add models to")
        args.kept_settings = json.loads(settings_file.read_text())
        vars(args).update(kept_settings(args.kept_settings))
        args.hardware = Path(args.kept_settings["hardware"])
        args.seeds = [secrets.randbelow(2**31) for _ in range(args.more)]
    return args


DENSE_FIELDS = ("dense_ms_per_ksample", "dense_params_mb")  # what --calibrate dense measures and counts
SETTINGS = ("nodes", "gpus_per_node", "link_mbit", "rounds", "steps", "warmup_steps", "batch_size", "measured_seconds")
SETTING_DEFAULTS = {"measured_seconds": None}  # settings added since some sweeps were kept: what those ran with


def kept_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A kept sweep's SETTINGS (its sweep.json), those it predates at what it ran with; KeyError with the list of
    those it lacks."""
    missing = [k for k in SETTINGS if k not in settings and k not in SETTING_DEFAULTS]
    if missing:
        raise KeyError(missing)
    return {k: settings[k] if k in settings else SETTING_DEFAULTS[k] for k in SETTINGS}


def reprice(args: argparse.Namespace) -> int:
    """--reprice: the kept sweep (its settings, cluster file and every model's rounds) priced again."""
    folder = args.out.with_suffix("")
    kept = json.loads((folder / "sweep.json").read_text())
    vars(args).update(kept_settings(kept))
    # sweeps before the measured window left it out counted the pipeline's last step (jobs.measured_window)
    args.last_step_measured = kept.get("last_step_measured", False)
    outcomes = [priced(model_folder(args.out, seed)) for seed in kept_seeds(folder)]
    text = markdown(outcomes, args, Path(kept["hardware"]), sum(o.seconds for o in outcomes), kept.get("note", ""))
    args.out.write_text(text)
    print(text)
    if args.write_error is not None:
        write_error(Path(kept["hardware"]), args.write_error, outcomes)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reprice:
        return reprice(args)
    if not cluster_ready("sweep.py"):
        return 2
    start, outcomes = time.perf_counter(), []
    earlier = 0.0  # --more: the kept models' seconds
    if args.more:
        outcomes = [priced(model_folder(args.out, seed)) for seed in kept_seeds(args.out.with_suffix(""))]
        earlier = sum(o.seconds for o in outcomes)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        hardware = args.hardware
        if hardware is None:
            first = generate_model(args.seeds[0], RANGES)
            spec_file = tmp / "calibration_model.json"
            spec_file.write_text(json.dumps(first.to_dict()))
            print("calibrating the cluster (quick, once for every model)", flush=True)
            out = args.out.with_suffix(".md")
            hardware = calibrate(cluster_run(args, str(spec_file), args.nodes, args.link_mbit[0], None, out), tmp)
        folder = args.out.with_suffix("")
        folder.mkdir(parents=True, exist_ok=True)
        settings = {k: getattr(args, k) for k in SETTINGS} | {"hardware": str(display(hardware))}
        if args.more:
            settings = args.kept_settings  # the kept sweep's, note and all
        if args.remeasure is not None:
            settings["note"] = (
                f"**Measured again (--remeasure).** The models and plans of `{display(args.remeasure)}`, not planned "
                "again: today's runtime and cost model on plans it did not choose."
            )
        (folder / "sweep.json").write_text(json.dumps(settings, indent=1))
        try:
            if args.remeasure is not None:
                outcomes = remeasure(args, tmp)
            else:
                for seed in args.seeds:
                    outcomes.append(measure(args, seed, hardware, tmp))
                    elapsed = earlier + time.perf_counter() - start
                    args.out.write_text(markdown(outcomes, args, hardware, elapsed))
        except (KeyboardInterrupt, RuntimeError):
            if not INTERRUPTS:
                raise
            print(f"sweep.py: interrupted; {args.out} holds the {len(outcomes)} models done", file=sys.stderr)
            return 130
    elapsed = earlier + time.perf_counter() - start
    text = markdown(outcomes, args, hardware, elapsed, settings.get("note", ""))
    args.out.write_text(text)
    print(text)
    if args.write_error is not None:
        write_error(hardware, args.write_error, outcomes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
