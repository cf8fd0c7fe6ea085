"""A Plan as TorchRec's ShardingPlan entries: the one adapter from our layouts to ParameterSharding."""

from __future__ import annotations

from typing import Any

from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding

from ..plan.groups import DATA_PARALLEL, sharding_type
from ..plan.layout import SHARDING_TYPE_PREFIX, Plan, sharding_type_name
from ..plan.spec import ModelSpec, TableSpec

# TorchRec's EmbeddingCollection runs these built-in types exactly; every other layout of a sequence
# table runs as ours (TorchRec's sequence column-wise needs one width for all its tables)
SEQUENCE_BUILTIN_TYPES = (DATA_PARALLEL, "table_wise", "row_wise")


def module_sharding_plan(
    plan: Plan, spec: ModelSpec, compute_device: str = "cuda", builtin: tuple[str, ...] | None = None
) -> Any:
    """A Plan as torchrec's EmbeddingModuleShardingPlan (one ParameterSharding per table): our
    sharding-type strings where no built-in type runs a layout exactly (plan/groups.py), or where the
    built-in type is not in `builtin` (None: any)."""
    lws = plan.local_world_size
    out = EmbeddingModuleShardingPlan()
    for t in spec.tables:
        layout = plan[t.name]
        kind = sharding_type(layout, t.rows, plan.world_size, lws)
        if builtin is not None and kind not in builtin and not kind.startswith(SHARDING_TYPE_PREFIX):
            kind = sharding_type_name(layout)
        if kind == DATA_PARALLEL:
            out[t.name] = ParameterSharding(
                sharding_type=kind, compute_kernel="dense", ranks=list(range(plan.world_size))
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
            sharding_type=kind,
            compute_kernel="fused",
            ranks=[s.rank for s in shards],
            sharding_spec=EnumerableShardingSpec(metadata),
        )
    return out


def sequence_sharding_plan(plan: Plan, collection: Any, compute_device: str = "cuda") -> Any:
    """module_sharding_plan for a TorchRec EmbeddingCollection (sequence tables: one vector per ID),
    whose tables ModelSpec.from_module does not read; the plan is validated against the collection
    first (every table covered once, no rank holding cells of one table in two widths), so a
    hand-made plan fails here by name rather than inside TorchRec."""
    tables = tuple(
        TableSpec(
            name=c.name, rows=c.num_embeddings, dim=c.embedding_dim, pooling=1.0, feature_names=tuple(c.feature_names)
        )
        for c in collection.embedding_configs()
    )
    spec = ModelSpec(name="sequence", batch_size=plan.world_size, tables=tables)
    plan.validate(spec)
    return module_sharding_plan(plan, spec, compute_device, SEQUENCE_BUILTIN_TYPES)
