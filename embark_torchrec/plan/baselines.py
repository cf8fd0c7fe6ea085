"""The plans we compare against, expressed as Plans so that one cost model scores them all.

- table-row-wise (TWRW), the EMBark paper's baseline: table i on node i mod N, its rows split over
  that node's GPUs in torchrec's ceil blocks, partial sums reduced inside the node first.
- TorchRec's default EmbeddingShardingPlanner, run on the same model, topology and memory cap, its
  ShardingPlan converted shard by shard.
"""

from __future__ import annotations

import math
from typing import Any

from .layout import SHARDING_TYPE_PREFIX, Plan, TableLayout, parse_sharding_type
from .spec import ModelSpec
from .topology import Topology

# torchrec sharding types whose partial sums are reduced inside the node before crossing it.
_HIERARCHICAL_TYPES = ("table_row_wise", "grid_shard")


def table_row_wise_plan(spec: ModelSpec, topology: Topology) -> Plan:
    lws = topology.local_world_size
    tables = {}
    for i, t in enumerate(spec.tables):
        node = i % topology.num_nodes
        block = math.ceil(t.rows / lws)
        bounds = tuple(range(0, t.rows, block)) + (t.rows,)
        ranks = tuple((node * lws + r,) for r in range(len(bounds) - 1))
        tables[t.name] = TableLayout("rb", bounds, (0, t.dim), ranks, hierarchical=len(ranks) > 1)
    return Plan(topology.world_size, lws, tables)


def from_sharding_plan(sharding_plan: Any, topology: Topology, module_path: str = "") -> Plan:
    """A torchrec ShardingPlan (one EmbeddingBagCollection) as a Plan; empty shards are dropped.
    Our own "embark_*" types carry their cluster, reduction and precision in the string."""
    if module_path:
        module_plan = sharding_plan.plan[module_path]
    else:
        (module_plan,) = sharding_plan.plan.values()
    tables: dict[str, Any] = {}
    for name, ps in module_plan.items():
        if ps.sharding_type == "data_parallel":
            tables[name] = {"cluster": "dp", "shards": []}
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
        entry: dict[str, Any] = {"cluster": "rb", "shards": shards, "hierarchical": ps.sharding_type in _HIERARCHICAL_TYPES}
        if ps.sharding_type.startswith(SHARDING_TYPE_PREFIX):
            cluster, hierarchical, precision = parse_sharding_type(ps.sharding_type)
            entry.update(cluster=cluster, hierarchical=hierarchical, precision={"forward": precision.forward, "backward": precision.backward})
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
    from torchrec.distributed.planner.types import Topology as TorchrecTopology

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


def meta_module(spec: ModelSpec) -> Any:
    """An EmbeddingBagCollection on the meta device with the spec's tables (no memory used)."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.feature_names))
        for t in spec.tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def torchrec_constraints(spec: ModelSpec) -> dict[str, Any]:
    from torchrec.distributed.planner.types import ParameterConstraints

    return {t.name: ParameterConstraints(pooling_factors=[t.pooling] * len(t.feature_names)) for t in spec.tables}


def torchrec_default_plan(spec: ModelSpec, topology: Topology) -> Plan:
    """Run torchrec's EmbeddingShardingPlanner with its defaults on our figures, as a Plan."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    planner = EmbeddingShardingPlanner(
        topology=torchrec_topology(topology),
        batch_size=spec.batch_size // topology.world_size,
        constraints=torchrec_constraints(spec),
    )
    sharding_plan = planner.plan(meta_module(spec), [EmbeddingBagCollectionSharder()])
    return from_sharding_plan(sharding_plan, topology)
