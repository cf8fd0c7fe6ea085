"""Pure planning: model specs, topologies, layouts, the cost model and the EMBark search.

The names a user plans with are re-exported here (numpy only: no torch, no torchrec), so that scripts and docs import
`from embark_torchrec.plan import ModelSpec, Topology, plan_model` instead of the modules that hold them.
"""

from .baselines import table_row_wise_plan
from .constraints import TableConstraints
from .cost import CostModel
from .layout import PRECISIONS, Plan, TableLayout, WirePrecision
from .plan_model import plan_model
from .profile import profile_features
from .report import render
from .search import SearchConfig
from .spec import IdDistribution, ModelSpec, TableSpec, builtin_model, load_model_spec
from .topology import Hardware, Topology

__all__ = [
    "PRECISIONS",
    "CostModel",
    "Hardware",
    "IdDistribution",
    "ModelSpec",
    "Plan",
    "SearchConfig",
    "TableConstraints",
    "TableLayout",
    "TableSpec",
    "Topology",
    "WirePrecision",
    "builtin_model",
    "load_model_spec",
    "plan_model",
    "profile_features",
    "render",
    "table_row_wise_plan",
]
