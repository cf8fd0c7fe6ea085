"""plan_model: the whole EMBark planning pipeline on a model spec, with no torchrec import.

The planner never returns a plan its own cost model prices slower than a baseline it knows of:
table-row-wise (the EMBark paper's, baselines.py), built and priced here when the tables have no
constraints, and any candidate plan the caller passes (EmbarkPlanner passes TorchRec's default
plan, which needs TorchRec's planner to build). A candidate counts only when it lays out every
table, fits every rank's memory and honours every table's constraints; the cheapest plan wins,
the search's on a tie, and a baseline that wins is logged.

One candidate may be the incumbent: the plan the user would run without us (EmbarkPlanner names TorchRec's default
plan). It is replaced only when the cheapest plan is predicted faster by more than the cost model has been measured
to miss a speedup by on this hardware (Hardware.speedup_band: the shortfall, plan_error_below, or plan_error): a gain
inside that error is not one the user can count on, and a plan only predicted faster may measure slower. PlanChoice
says which way it went, and why.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from .search.baselines import table_row_wise_plan
from .cost.bound import allowed_clusters
from .search.clusters import assign_clusters
from .layout.constraints import TableConstraints
from .cost.model import CostModel, OptimizerMemory, StepCost
from .layout.tables import Plan, PlanError, TableLayout
from .progress import Progress, progress_line
from .search.driver import PlanSearch
from .search.config import SearchConfig, SearchStats
from .model.spec import ModelSpec, TableSpec
from .model.topology import Topology
from .search.torchrec_fp8 import torchrec_fp8_groups

logger = logging.getLogger(__name__)
EMBARK = "embark"
TABLE_ROW_WISE = "table-row-wise"
_FREE = TableConstraints()


@dataclass(frozen=True)
class PlannedModel:
    """A plan with what it was planned for and what it is estimated to cost."""

    spec: ModelSpec
    topology: Topology
    plan: Plan
    cost: StepCost
    seconds: float
    clusters: Mapping[str, str] = field(default_factory=dict)
    stats: SearchStats | None = None
    source: str = EMBARK  # whose plan this is: the search's, or the baseline that priced faster
    choice: "PlanChoice | None" = None  # against the incumbent, when plan_model was given one


@dataclass(frozen=True)
class PlanChoice:
    """The best plan's predicted speedup over the incumbent's, the measured speedup to expect of it by the cost
    model's measured error on plan differences on this hardware (Hardware.speedup_band; None: not measured), and the
    plan returned: the incumbent's unless the band's low end is a gain."""

    incumbent: str
    best: str  # the cheapest plan other than the incumbent's
    predicted_speedup: float  # the incumbent's estimated step / the best's
    band: tuple[float, float] | None  # the lowest and highest measured speedup the error allows
    chosen: str

    @property
    def kept(self) -> bool:
        return self.chosen == self.incumbent

    def sentence(self) -> str:
        """What the report says: the speedup expected, with its band, or why the incumbent's plan was kept."""
        speedup, band = self.predicted_speedup, self.band
        if self.kept:
            if speedup <= 1.0:
                return f"kept {self.incumbent}'s plan: it is estimated at least as fast as the {self.best} plan"
            assert band is not None  # a predicted gain is kept only inside a measured band
            return (
                f"kept {self.incumbent}'s plan: the {self.best} plan is predicted {speedup:.2f}x its speed, within the "
                f"cost model's measured error on plan differences here ({band[0]:.2f}x to {band[1]:.2f}x)"
            )
        if band is None:
            return (
                f"predicted {speedup:.2f}x {self.incumbent}'s plan's speed; the cost model's error on plan differences "
                "has not been measured on this hardware (hardware fields plan_error_below/plan_error_above, measured "
                "by benchmarks/plan_band.py)"
            )
        return (
            f"predicted {speedup:.2f}x {self.incumbent}'s plan's speed, {band[0]:.2f}x to {band[1]:.2f}x within the "
            "cost model's measured error on plan differences here"
        )


class CostError(ValueError):
    """A plan whose estimated cost is not a finite number: the ranges of ranges.py keep every cost finite, so this
    is the backstop, and no such plan is returned or written."""


def check_finite(name: str, cost: StepCost, bound_ms: float | None = None, outcome: str = "no plan returned") -> None:
    """Refuses the `name` plan when its estimated step, any part of it, any rank's load or memory, or the lower
    bound (`bound_ms`, when known) is not a finite number, naming the part (then `outcome`: what the caller does
    not do)."""
    parts = cost.parts()
    step = parts.pop("step_ms")  # the sum of the others: name the part at fault first
    figures = {**parts, "step_ms": step, "lower bound": 0.0 if bound_ms is None else bound_ms}
    for part, value in figures.items():
        if not math.isfinite(value):
            raise CostError(f"the {name} plan's estimated {part} is {value}, not a finite number; {outcome}")
    for part, per_rank in (("load ms", cost.rank_load_ms), ("memory bytes", cost.rank_memory)):
        bad = np.flatnonzero(~np.isfinite(per_rank))
        if bad.size:
            rank = int(bad[0])
            raise CostError(
                f"the {name} plan's estimated {part} of rank {rank} is {per_rank[rank]}, not a finite number; {outcome}"
            )


def refusal(t: TableSpec, layout: TableLayout, constraints: TableConstraints, world_size: int) -> str | None:
    """Why this layout of the table breaks its constraints (fixed layout, clusters, cuts, fewest
    slices, narrowest columns, allowed ranks, precision) or the plan's rules, or None."""
    name = t.name
    if constraints.layout is not None:
        return None if layout == constraints.layout else "its layout is fixed"
    if layout.cluster not in allowed_clusters(constraints):
        return f"cluster {layout.cluster} is not allowed"
    if constraints.precision is not None and layout.precision != constraints.precision:
        return f"precision {layout.precision} is not {constraints.precision}"
    if layout.kind.replicated:
        return None
    try:
        layout.validate(name, t.rows, t.dim, world_size)
    except PlanError as e:
        return str(e)
    n_r, n_c = layout.num_row_slices, layout.num_col_slices
    if n_r < constraints.min_cuts[0] or n_c < constraints.min_cuts[1]:
        return f"fewer than {constraints.min_cuts} slices"
    if (
        (n_r > 1 and not constraints.row_cuts)
        or (n_c > 1 and not constraints.column_cuts)
        or (n_r > 1 < n_c and not constraints.grid_cuts)
    ):
        return "cuts not allowed"
    if min(np.diff(layout.col_bounds)) < constraints.min_column_width:
        return f"columns narrower than {constraints.min_column_width}"
    if constraints.ranks is not None and not layout.used_ranks() <= set(constraints.ranks):
        return "ranks not allowed"
    return None


def _usable(plan: Plan, spec: ModelSpec, topology: Topology, constraints: Mapping[str, TableConstraints]) -> str | None:
    """Why a candidate plan may not be returned (another world, a table missing, extra or refused), or None."""
    if plan.world_size != topology.world_size or plan.local_world_size != topology.local_world_size:
        return f"it is for {plan.world_size} ranks of {plan.local_world_size} per node"
    names = {t.name for t in spec.tables}
    if set(plan.tables) != names:
        return f"it lays out tables {sorted(set(plan.tables) ^ names)} the model has not, or not these"
    for t in spec.tables:
        why = refusal(t, plan.tables[t.name], constraints.get(t.name, _FREE), topology.world_size)
        if why is not None:
            return f"table {t.name!r}: {why}"
    return None


def _cheapest(
    planned: tuple[Plan, StepCost],
    candidates: Mapping[str, Plan],
    cost: CostModel,
    constraints: Mapping[str, TableConstraints],
    incumbents: Sequence[str] = (),
) -> tuple[str, Plan, StepCost, PlanChoice | None]:
    """The search's plan, or the usable candidate its cost model prices faster (the first on a tie); but the
    incumbent's (the cheapest usable of the candidates named `incumbents`) while the cheapest is not predicted faster
    by more than the cost model's measured error on plan differences (Hardware.speedup_band)."""
    topology = cost.topology
    priced: dict[str, tuple[Plan, StepCost]] = {EMBARK: planned}
    for name, candidate in candidates.items():
        why = _usable(candidate, cost.spec, topology, constraints)
        if why is not None:
            logger.debug("the %s plan is not considered: %s", name, why)
            continue
        candidate_step = cost.evaluate(candidate)
        if candidate_step.rank_memory.max() <= topology.hbm_cap_bytes:
            priced[name] = (candidate, candidate_step)
    choice = None
    standing = [name for name in incumbents if name in priced]
    if standing:
        incumbent = min(standing, key=lambda name: priced[name][1].step_ms)  # the first on a tie
        others = {name: p for name, p in priced.items() if name != incumbent}
        best = min(others, key=lambda name: others[name][1].step_ms)  # the first on a tie: the search's
        speedup = priced[incumbent][1].step_ms / others[best][1].step_ms
        band = topology.hardware.speedup_band(speedup)
        kept = speedup <= 1.0 or (band is not None and band[0] <= 1.0)
        choice = PlanChoice(incumbent, best, speedup, band, incumbent if kept else best)
        source = choice.chosen
    else:
        source = min(priced, key=lambda name: priced[name][1].step_ms)
    plan, step = priced[source]
    if source != EMBARK:
        logger.info(
            "the %s plan (%.3f ms) is returned rather than the search's (%.3f ms)%s",
            source,
            step.step_ms,
            planned[1].step_ms,
            f": {choice.sentence()}" if choice is not None else ", which the cost model prices slower",
        )
    return source, plan, step, choice


def plan_model(
    spec: ModelSpec,
    topology: Topology,
    constraints: Mapping[str, TableConstraints] | None = None,
    config: SearchConfig | None = None,
    optimizer: OptimizerMemory | None = None,
    progress: bool | Progress | None = None,
    candidates: Mapping[str, Plan] | None = None,
    incumbent: str | Sequence[str] | None = None,
) -> PlannedModel:
    """Clusters, then the greedy 3D search; the result is validated against every invariant.

    The search is greedy, so its plan is also compared with the table-row-wise baseline (EMBark's
    reference layout; when no table has constraints) and with `candidates` (by name, e.g.
    TorchRec's default plan), and the cheapest that fits memory and honours the constraints is
    returned (PlannedModel.source names it). `incumbent`, one of the candidates' names or several (EmbarkPlanner:
    TorchRec's default plans; of several, the cheapest usable one stands), is returned instead unless the cheapest is
    predicted faster than it by more than the cost model's measured error on plan differences (Hardware.speedup_band);
    PlannedModel.choice says which way it went.

    progress: a Progress to call as planning goes; True draws a ProgressLine on stderr, False
    nothing, None (the default) a ProgressLine when stderr is a terminal (it shows only once
    planning has taken a few seconds).

    Raises CostError when the returned plan's estimated cost is not finite (as the CLI refuses to write one)."""
    start = time.perf_counter()
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - {t.name for t in spec.tables})
    if unknown:
        raise ValueError(f"constraints name tables the model does not have: {unknown}")
    incumbents = (incumbent,) if isinstance(incumbent, str) else tuple(incumbent or ())
    for name in incumbents:
        if name not in (candidates or {}):
            raise ValueError(f"incumbent {name!r} is not one of the candidates {sorted(candidates or {})}")
    own_line = progress is None or isinstance(progress, bool)
    line = progress_line(progress, f"planning {spec.name}") if own_line else None
    report = line if own_line else progress
    try:
        config = config or SearchConfig()
        cost = CostModel(spec, topology, optimizer)
        clusters = assign_clusters(cost, constraints, config.dp_memory_fraction, report)
        search = PlanSearch(cost, clusters, constraints, config, report)
        plan = search.run()
        clusters = {name: layout.cluster for name, layout in plan.tables.items()}  # phase 3 may re-cluster
        if report is not None:
            report("scoring", 0, None, "")
        plan, step = torchrec_fp8_groups(cost, plan, cost.evaluate(plan), constraints, config.torchrec_fp8_tolerance)
        if report is not None:
            report("scoring the baselines", 0, None, "")
        baselines = {TABLE_ROW_WISE: table_row_wise_plan(spec, topology)}
        source, plan, step, choice = _cheapest(
            (plan, step), {**baselines, **(candidates or {})}, cost, constraints, incumbents
        )
        if source != EMBARK:
            clusters = {name: layout.cluster for name, layout in plan.tables.items()}
        check_finite(source, step)
        if report is not None:
            report("validating", 0, None, "")
        plan.validate(spec, step.rank_memory, topology.hbm_cap_bytes)
    finally:
        if line is not None:
            line.close()
    seconds = time.perf_counter() - start
    return PlannedModel(spec, topology, plan, step, seconds, clusters, search.stats, source, choice)
