"""TorchRec's planning boundary, above `plan/` (pure planning) and `sharding/` (the runtime), as TorchRec's own
planner stands above its sharders: EmbarkPlanner (a ShardingPlanner), plan files into ShardingPlans, and TorchRec's
plans and planner inputs into ours."""

from .load_plan import load_plan
from .parameter_sharding import module_sharding_plan
from .planner import EmbarkPlanner
from .torchrec_plans import from_sharding_plan, torchrec_constraints, torchrec_default_plan, torchrec_topology

__all__ = [
    "EmbarkPlanner",
    "from_sharding_plan",
    "load_plan",
    "module_sharding_plan",
    "torchrec_constraints",
    "torchrec_default_plan",
    "torchrec_topology",
]
