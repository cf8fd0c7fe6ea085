"""Pure planning (numpy only: no torch, no torchrec): what is planned (model/), what a plan is (layout/), what it
costs (cost/) and how it is found (search/), run end to end by plan_model and shown by render.

The names a user plans with are re-exported here. Inside plan/, modules import each other by their own module path,
never from this package, so that this file may import any of them.
"""

from .cli import UsageError, check_output
from .cost.model import CostModel, StepCost
from .layout.constraints import TableConstraints
from .layout.groups import ShardingGroup
from .layout.tables import (
    ALLREDUCE_PRECISIONS,
    PRECISIONS,
    Plan,
    PlanError,
    TableLayout,
    WirePrecision,
)
from .layout.torchrec_types import ceil_row_bounds
from .layout.wire import ELEMENT_BYTES
from .model.hardware_file import check_document, hardware_sources, names_a_file, resolve_hardware, save_hardware
from .model.profile import profile_features
from .model.spec import IdDistribution, ModelSpec, SpecError, TableSpec, builtin_model, load_model_spec
from .model.topology import PRESETS, Hardware, Topology, hardware_preset
from .plan_model import PlannedModel, plan_model
from .report import ScoredPlan, render
from .search.baselines import table_row_wise_plan
from .search.config import SearchConfig

__all__ = [
    "ALLREDUCE_PRECISIONS",
    "CostModel",
    "ELEMENT_BYTES",
    "Hardware",
    "IdDistribution",
    "ModelSpec",
    "PRECISIONS",
    "PRESETS",
    "Plan",
    "PlanError",
    "PlannedModel",
    "ScoredPlan",
    "SearchConfig",
    "ShardingGroup",
    "SpecError",
    "StepCost",
    "TableConstraints",
    "TableLayout",
    "TableSpec",
    "Topology",
    "UsageError",
    "WirePrecision",
    "builtin_model",
    "ceil_row_bounds",
    "check_document",
    "check_output",
    "hardware_preset",
    "hardware_sources",
    "load_model_spec",
    "names_a_file",
    "plan_model",
    "profile_features",
    "render",
    "resolve_hardware",
    "save_hardware",
    "table_row_wise_plan",
]
