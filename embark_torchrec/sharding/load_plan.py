"""load_plan: a plan file into the ShardingPlan that DistributedModelParallel takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from ..plan.fields import reading
from ..plan.layout import Plan, PlanError
from ..plan.spec import ModelSpec
from .parameter_sharding import module_sharding_plan

# the collections a plan file lays out: pooled tables (EmbeddingBagCollection), sequence tables (EmbeddingCollection)
_COLLECTIONS = (EmbeddingBagCollection, EmbeddingCollection)


def load_plan(
    plan: str | Path | Mapping[str, Any] | Plan,
    module: torch.nn.Module,
    world_size: int | None = None,
    compute_device: str | None = None,
) -> ShardingPlan:
    """Match the plan's tables by name to the EmbeddingBagCollections and EmbeddingCollections in
    `module` (nested ones too; one plan file may hold both kinds of tables).

    Refused with a PlanError naming the file (when given one), the module path and the table: a
    world size other than `world_size` (default: the initialised process group's), a table the
    module lacks or a module table the plan lacks, a table named in two collections, a table the
    plan records as another kind (sequence / pooled) than its collection's, and layouts that do not
    tile the module's tables exactly.
    """
    file = "" if isinstance(plan, (Mapping, Plan)) else str(plan)
    if isinstance(plan, Plan):
        loaded = plan
    elif isinstance(plan, Mapping):
        loaded = Plan.from_dict(plan)
    else:
        loaded = Plan.load(plan)
    with reading(PlanError, file=file):
        return _sharding_plan(loaded, module, world_size, compute_device)


def _sharding_plan(
    loaded: Plan, module: torch.nn.Module, world_size: int | None, compute_device: str | None
) -> ShardingPlan:
    """load_plan once the plan is read; errors name the module path of the table at fault."""
    expected_ws = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else None)
    if expected_ws is not None and loaded.world_size != expected_ws:
        raise PlanError(f"the plan is for world size {loaded.world_size}, but this job has {expected_ws} ranks")
    device = compute_device or ("cuda" if torch.cuda.is_available() else "cpu")
    owners: dict[str, str] = {}
    collections = [(path, m) for path, m in module.named_modules() if isinstance(m, _COLLECTIONS)]
    if not collections:
        raise PlanError("the module has no EmbeddingBagCollection or EmbeddingCollection to apply the plan to")
    result = ShardingPlan(plan={})
    for path, collection in collections:
        spec = ModelSpec.from_module(collection, batch_size=loaded.world_size)
        collection_type = type(collection).__name__
        where = f"{collection_type} at {path!r}" if path else f"the model ({collection_type})"
        for t in spec.tables:
            if t.name in owners:
                raise PlanError(
                    f"table {t.name!r} is in two collections ({owners[t.name]!r} and {path!r}); plan files name tables"
                )
            owners[t.name] = path
        with reading(PlanError, where=where):
            missing = [t.name for t in spec.tables if t.name not in loaded.tables]
            if missing:
                raise PlanError(f"the plan has no layout for tables {missing}")
            names = [t.name for t in spec.tables]
            sub = Plan(
                loaded.world_size,
                loaded.local_world_size,
                {n: loaded[n] for n in names},
                {n: loaded.kinds[n] for n in names if n in loaded.kinds},
            )
            sub.validate(spec)
        result.plan[path] = module_sharding_plan(sub, spec, device)
    extra = sorted(set(loaded.tables) - set(owners))
    if extra:
        raise PlanError(f"the plan lays out tables {extra} that the module does not have")
    return result
