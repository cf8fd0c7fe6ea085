"""Which fp8 table-wise and column-wise tables run on TorchRec's own sharding (TableLayout.torchrec_at_fp8).

At fp16 / bf16 a layout TorchRec's sharding runs always runs on it: the precision is a codec registry on the same
group. fp8 scales each vector, so its codec must know each row's width, and TorchRec's dists size a message by its
element count alone: on TorchRec's sharding a table-wise or column-wise table at fp8 needs a group of its row width
(a group's collectives more per width) and TorchRec's int64 IDs, where ours sends every width in one group with
int32 IDs. Forced for every such table, that priced the fp8 plans of benchmarks/plan_identity.py's sweep a median
3% slower (up to 47% on the many widths of mixed300 at 64 GPUs). So the planner decides per group of one width:
after the search, each such group moves to TorchRec's sharding while the whole plan's step stays within
SearchConfig.torchrec_fp8_tolerance of the search's (0 by default: only where it is not slower, ties going to
TorchRec's; math.inf: every such table, the design card's shape at its price).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Mapping

from ..layout.constraints import TableConstraints
from ..cost.model import CostModel, StepCost
from ..layout.groups import ShardingGroup, sharding_group
from ..layout.tables import Plan
from ..model.fields import SEQUENCE


def torchrec_fp8_groups(
    cost: CostModel,
    plan: Plan,
    step: StepCost,
    constraints: Mapping[str, TableConstraints],
    tolerance: float = 0.0,
) -> tuple[Plan, StepCost]:
    """`plan` (priced `step`) with each would-be TorchRec fp8 group, its tables of one module, type, precision and row
    width (pooled ones first, each module's by sharding-type string), moved onto TorchRec's sharding while the step
    stays within `tolerance` of `step`'s; a table whose layout its constraints fix keeps it."""
    cap = step.step_ms * (1.0 + tolerance)
    topology = cost.topology
    groups: dict[ShardingGroup, list[str]] = defaultdict(list)
    for t in cost.spec.tables:
        layout = plan.tables[t.name]
        fixed = constraints.get(t.name, TableConstraints()).layout is not None
        if fixed or layout.torchrec_at_fp8 or layout.fp8_builtin_type(t.is_sequence) is None:
            continue
        group = sharding_group(
            replace(layout, torchrec_at_fp8=True), t.rows, topology.world_size, topology.local_world_size, t.is_sequence
        )
        groups[group].append(t.name)
    for group in sorted(groups, key=lambda g: (g.module == SEQUENCE, g.name)):
        moved = {n: replace(plan.tables[n], torchrec_at_fp8=True) for n in groups[group]}
        trial = replace(plan, tables={**plan.tables, **moved})
        trial_step = cost.evaluate(trial)
        if trial_step.step_ms <= cap:
            plan, step = trial, trial_step
    return plan, step
