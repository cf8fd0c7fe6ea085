"""TorchRec's default plan as a Plan, so that our cost model scores it beside ours: TorchRec's
EmbeddingShardingPlanner run on the same model, topology and memory cap, its ShardingPlan converted
shard by shard. Sequence tables are planned as TorchRec plans them, in an EmbeddingCollection."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.planner.types import Topology as TorchrecTopology
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from ..plan.layout.kinds import DATA_PARALLEL_KIND, REDUCTION_KIND
from ..plan.model.fields import POOLED, SEQUENCE
from ..plan.layout.groups import ShardingGroup
from ..plan.layout.tables import Plan
from ..plan.model.spec import ModelSpec
from ..plan.layout.torchrec_types import DATA_PARALLEL
from ..plan.model.topology import Topology

# torchrec sharding types whose partial sums are reduced inside the node before crossing it.
_HIERARCHICAL_TYPES = ("table_row_wise", "grid_shard")


def from_sharding_plan(sharding_plan: Any, topology: Topology, module_path: str = "") -> Plan:
    """One module of a torchrec ShardingPlan (an EmbeddingBagCollection or EmbeddingCollection) as a
    Plan; empty shards are dropped.
    Our own "embark_*" types carry their cluster, reduction and precision in the string; a built-in type
    of ours below fp32 its precision ("table_wise:fp16-fp16"), at fp8 also its row width ("table_wise:fp8-fp8@64":
    the layout's torchrec_at_fp8)."""
    if module_path:
        module_plan = sharding_plan.plan[module_path]
    else:
        (module_plan,) = sharding_plan.plan.values()
    tables: dict[str, Any] = {}
    for name, ps in module_plan.items():
        if ps.sharding_type == DATA_PARALLEL:
            tables[name] = {"cluster": DATA_PARALLEL_KIND.name, "shards": []}
            continue
        shards = [
            {
                "rows": [m.shard_offsets[0], m.shard_offsets[0] + m.shard_sizes[0]],
                "cols": [m.shard_offsets[1], m.shard_offsets[1] + m.shard_sizes[1]],
                "rank": m.placement.rank(),
            }
            for m in ps.sharding_spec.shards
            if m.shard_sizes[0] > 0 and m.shard_sizes[1] > 0
        ]
        group = ShardingGroup.parse(ps.sharding_type)
        if group.torchrec_type is None:
            cluster, hierarchical = group.runner, group.hierarchical
        else:
            cluster, hierarchical = REDUCTION_KIND.name, group.torchrec_type in _HIERARCHICAL_TYPES
        entry: dict[str, Any] = {
            "cluster": cluster,
            "shards": shards,
            "hierarchical": hierarchical,
            "precision": {"forward": group.precision.forward, "backward": group.precision.backward},
        }
        if group.row_width:  # TorchRec's type at fp8, one group per row width
            entry["torchrec_at_fp8"] = True
        tables[name] = entry
    return Plan.from_dict(
        {
            "format": "embark-plan",
            "version": 1,
            "world_size": topology.world_size,
            "local_world_size": topology.local_world_size,
            "tables": tables,
        }
    )


def torchrec_topology(topology: Topology, compute_device: str = "cuda") -> Any:
    """torchrec's planner Topology with our hardware figures (its bandwidths are in bytes/ms)."""
    hw = topology.hardware
    return TorchrecTopology(
        world_size=topology.world_size,
        local_world_size=topology.local_world_size,
        compute_device=compute_device,
        hbm_cap=int(topology.hbm_cap_bytes),
        hbm_mem_bw=hw.hbm_bw_gbps * 1e6,
        intra_host_bw=hw.intra_node_bw_gbps * 1e6,
        inter_host_bw=hw.inter_node_bw_gbps * 1e6,
    )


# TorchRec's module and table config for each table kind
_TORCHREC_MODULES = {
    POOLED: (EmbeddingBagCollection, EmbeddingBagConfig),
    SEQUENCE: (EmbeddingCollection, EmbeddingConfig),
}


def meta_module(spec: ModelSpec) -> torch.nn.ModuleDict:
    """The spec's tables on the meta device (no memory used), as TorchRec holds them: its pooled
    tables in an EmbeddingBagCollection at "pooled", its sequence tables in an EmbeddingCollection at
    "sequence" (each only if the spec has such tables)."""
    collections: dict[str, torch.nn.Module] = {}
    for kind, (collection, config) in _TORCHREC_MODULES.items():
        configs = [
            config(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.feature_names))
            for t in spec.tables
            if t.kind == kind
        ]
        if configs:
            collections[kind] = collection(tables=configs, device=torch.device("meta"))
    return torch.nn.ModuleDict(collections)


def torchrec_constraints(spec: ModelSpec) -> dict[str, Any]:
    return {t.name: ParameterConstraints(pooling_factors=[t.pooling] * len(t.feature_names)) for t in spec.tables}


def torchrec_default_plan(
    spec: ModelSpec, topology: Topology, compute_device: str = "cuda", sharders: Sequence[Any] = ()
) -> Plan:
    """Run torchrec's EmbeddingShardingPlanner with its defaults on our figures, as a Plan (with the
    spec's table kinds): pooled tables by an EmbeddingBagCollection's sharder, sequence tables by an
    EmbeddingCollection's, each the job's among `sharders` where one shards that module type (TorchRec's planner
    offers a module only its sharder's sharding types: ours offer every built-in type on CPU too, where TorchRec's
    own offer no row-wise one, and their fused parameters size the optimizer state), else TorchRec's own
    (its EmbeddingCollectionSharder offers only the types TorchRec's EmbeddingCollection runs).
    `compute_device`: the job's, as a user gives TorchRec's Topology (its plans for CPU and CUDA differ)."""
    planner = EmbeddingShardingPlanner(
        topology=torchrec_topology(topology, compute_device),
        batch_size=spec.batch_size // topology.world_size,
        constraints=torchrec_constraints(spec),
    )
    given = {sharder.module_type: sharder for sharder in sharders}
    defaults = (EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder())
    sharding_plan = planner.plan(meta_module(spec), [given.get(d.module_type, d) for d in defaults])
    parts = [from_sharding_plan(sharding_plan, topology, path) for path in sharding_plan.plan]
    layouts = {name: layout for part in parts for name, layout in part.tables.items()}
    tables = {t.name: layouts[t.name] for t in spec.tables}
    return Plan(topology.world_size, topology.local_world_size, tables).with_kinds(spec)
