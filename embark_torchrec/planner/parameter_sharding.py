"""A Plan as TorchRec's ShardingPlan entries: the one adapter from our layouts to ParameterSharding."""

from __future__ import annotations

from typing import Any

from torch.distributed._shard.sharding_spec import ShardMetadata
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding

from ..plan.layout.groups import DATA_PARALLEL, sharding_group
from ..plan.layout.tables import Plan
from ..plan.model.spec import ModelSpec
from ..sharding.torchrec_compat import tiled_sharding_spec


def module_sharding_plan(plan: Plan, spec: ModelSpec, compute_device: str = "cuda") -> Any:
    """A Plan as torchrec's EmbeddingModuleShardingPlan (one ParameterSharding per table, its type string the
    table's ShardingGroup.name): ours where no built-in type runs a layout exactly (plan/layout/groups.py; for
    sequence tables, where TorchRec's EmbeddingCollection has no such type)."""
    lws = plan.local_world_size
    out = EmbeddingModuleShardingPlan()
    for t in spec.tables:
        layout = plan[t.name]
        group = sharding_group(layout, t.rows, plan.world_size, lws, t.is_sequence)
        if group.torchrec_type == DATA_PARALLEL:
            out[t.name] = ParameterSharding(
                sharding_type=group.name, compute_kernel="dense", ranks=list(range(plan.world_size))
            )
            continue
        shards = list(layout.shards())
        device = (
            (lambda k: f"rank:{k}/cuda:{k % lws}")
            if compute_device == "cuda"
            else (lambda k: f"rank:{k}/{compute_device}")
        )
        metadata = [
            ShardMetadata(
                shard_offsets=[s.rows[0], s.cols[0]],
                shard_sizes=[s.rows[1] - s.rows[0], s.cols[1] - s.cols[0]],
                placement=device(s.rank),
            )
            for s in shards
        ]
        out[t.name] = ParameterSharding(
            sharding_type=group.name,
            compute_kernel="fused",
            ranks=[s.rank for s in shards],
            sharding_spec=tiled_sharding_spec(metadata),
        )
    return out


def sequence_sharding_plan(plan: Plan, collection: Any, compute_device: str = "cuda") -> Any:
    """module_sharding_plan for a TorchRec EmbeddingCollection (sequence tables: one vector per ID);
    the plan is validated against the collection first (every table covered once, no rank holding
    cells of one table in two widths), so a hand-made plan fails here by name rather than inside
    TorchRec."""
    spec = ModelSpec.from_module(collection, batch_size=plan.world_size, name="sequence")
    plan.validate(spec)
    return module_sharding_plan(plan, spec, compute_device)
