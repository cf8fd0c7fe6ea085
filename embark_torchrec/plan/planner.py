"""EmbarkPlanner: a torchrec ShardingPlanner that plans with EMBark's clusters and 3D search.

It wraps `plan_model` (spec + topology -> Plan) for torchrec modules and turns the Plan into the
ShardingPlan that DistributedModelParallel takes (sharding/parameter_sharding.py). Every
EmbeddingBagCollection (pooled tables) and EmbeddingCollection (sequence tables) that a given sharder
shards is planned in one search: their tables share the ranks' memory, lookups and links.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
import warnings
from typing import Any, Mapping

import torch
from torchrec.distributed.types import ShardingPlan, ShardingPlanner

from .constraints import TableConstraints, from_torchrec
from .cost import CostModel, OptimizerMemory
from .layout import SHARDING_TYPE_PREFIX, Plan, TableLayout, ceil_row_bounds
from .report import ScoredPlan, render
from .plan_model import PlannedModel, plan_model
from .search import SearchConfig
from .spec import IdDistribution, ModelSpec
from .hardware_file import resolve_hardware
from .topology import CPU_HARDWARE, DEFAULT_HARDWARE, Hardware, Topology


# GPU names (torch.cuda.get_device_name) to our presets, first match wins
_GPU_PRESETS = (("H200", "h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100"))


def default_hardware(compute_device: str) -> str:
    """The preset for the device in use: cpu-gloo on CPU; on CUDA the one matching the GPU's name,
    else dgx-h100 with a warning that names the GPU."""
    if compute_device != "cuda":
        return CPU_HARDWARE
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "an unknown GPU"
    for key, preset in _GPU_PRESETS:
        if key in name:
            return preset
    warnings.warn(f"no hardware preset matches {name!r}; planning with {DEFAULT_HARDWARE}'s figures (pass hardware=)")
    return DEFAULT_HARDWARE


def hardware_from_torchrec(base: Hardware, topology: Any, storage_reservation: Any) -> Hardware:
    """`base` with what a TorchRec Topology and storage reservation say: memory per device (the
    smallest, if they differ: HBM on GPUs, host memory on CPUs, where TorchRec keeps the tables
    there), bandwidths (TorchRec's bytes/ms are GB/s x 1e6), the reserve. Values equal to TorchRec's
    defaults were not said by the user (a Topology always carries them) and leave the preset's."""
    from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, DDR_CAP, HBM_CAP, INTRA_NODE_BANDWIDTH

    overrides: dict[str, float] = {}
    if topology is not None:
        on_cpu = topology.compute_device == "cpu"
        memory = min(d.storage.ddr if on_cpu else d.storage.hbm for d in topology.devices)
        if memory != (DDR_CAP if on_cpu else HBM_CAP):
            overrides["hbm_gb"] = memory / 1e9
        if topology.intra_host_bw != INTRA_NODE_BANDWIDTH:
            overrides["intra_node_bw_gbps"] = topology.intra_host_bw / 1e6
        if topology.inter_host_bw != CROSS_NODE_BANDWIDTH:
            overrides["inter_node_bw_gbps"] = topology.inter_host_bw / 1e6
    if storage_reservation is not None:
        percentage = float(getattr(storage_reservation, "_percentage", 0.0))
        overrides["hbm_reserve_gb"] = percentage * overrides.get("hbm_gb", base.hbm_gb)
    return base.with_overrides(**overrides) if overrides else base


def _check_sharders(result: Any, modules: list["_Planned"], sharders: list[Any]) -> None:
    """Refuses, before any module is sharded, a plan that uses our sharding types on a module whose
    given sharders cannot run them (TorchRec's own would fail deep inside DistributedModelParallel)."""
    from ..sharding.sharded_ec import EmbarkEmbeddingCollectionSharder
    from ..sharding.sharder import EmbarkEmbeddingBagCollectionSharder

    for m in modules:
        needed = (
            EmbarkEmbeddingCollectionSharder if m.spec.tables[0].is_sequence else EmbarkEmbeddingBagCollectionSharder
        )
        if any(isinstance(s, needed) for s in sharders if isinstance(m.module, s.module_type)):
            continue
        ours = [
            f"{m.path or 'model'}.{table}"
            for table, ps in result.plan[m.path].items()
            if ps.sharding_type.startswith(SHARDING_TYPE_PREFIX)
        ]
        if ours:
            raise ValueError(
                f"the plan runs tables {ours[:5]}{' ...' if len(ours) > 5 else ''} on embark sharding types, which "
                f"the given sharders cannot run: pass {needed.__name__}() to the planner and to "
                "DistributedModelParallel(sharders=[...])"
            )


def _sharders_accept(module: Any, sharders: list[Any]) -> bool:
    return any(isinstance(module, s.module_type) for s in sharders)


def _collection(module: Any) -> Any:
    """The table collection a module plans: an EmbeddingBagCollection or EmbeddingCollection itself,
    or the EmbeddingBagCollection inside a managed-collision one (None for other modules)."""
    from ..sharding.torchrec_compat import managed_collision_embeddings

    inner = managed_collision_embeddings(module)
    if inner is not None:
        return inner
    return module if hasattr(module, "embedding_bag_configs") or hasattr(module, "embedding_configs") else None


@dataclass(frozen=True)
class _Planned:
    """One module the planner plans: its path, the module the sharder shards, its tables' spec, and
    each table's name in the one spec all modules are planned in (unique across modules)."""

    path: str
    module: Any
    spec: ModelSpec
    names: Mapping[str, str]
    managed_collisions: bool


def _planned_names(specs: list[tuple[str, ModelSpec]]) -> list[dict[str, str]]:
    """Each module's table names in the joint spec: its own, unless another planned module has a
    table of that name, then prefixed by the module's path (dots as underscores)."""
    counts: dict[str, int] = {}
    for _, spec in specs:
        for t in spec.tables:
            counts[t.name] = counts.get(t.name, 0) + 1
    return [
        {
            t.name: t.name if counts[t.name] == 1 else f"{path.replace('.', '_') or 'model'}__{t.name}"
            for t in spec.tables
        }
        for path, spec in specs
    ]


def _row_wise(rows: int, dim: int, world_size: int) -> TableLayout:
    """TorchRec's row-wise layout: even row blocks, one per rank."""
    bounds = ceil_row_bounds(rows, world_size)
    return TableLayout("rb", bounds, (0, dim), tuple((k,) for k in range(len(bounds) - 1)))


def _without_grids(
    module: Any, sharders: list[Any], names: set[str], constraints: Mapping[str, TableConstraints]
) -> dict[str, TableConstraints]:
    """`constraints` for the module's tables, forbidding row x column grids when the fused optimizer
    (the sharder's, or one apply_optimizer_in_backward gave its parameters) keeps per-row state
    (TorchRec's fused optimizer cannot lay that state out for them; see
    torchrec_compat.has_rowwise_state)."""
    from ..sharding.torchrec_compat import has_rowwise_state, in_backward_optimizers

    here = {k: v for k, v in constraints.items() if k in names}
    optimizers = [(s.fused_params or {}).get("optimizer") for s in sharders if isinstance(module, s.module_type)]
    optimizers += in_backward_optimizers(module)
    if not any(has_rowwise_state(o) for o in optimizers):
        return here
    return {n: replace(here.get(n, TableConstraints()), grid_cuts=False) for n in names}


class EmbarkPlanner(ShardingPlanner):
    """Drop-in for torchrec's EmbeddingShardingPlanner.

    It takes TorchRec's arguments (topology, batch_size, constraints, storage_reservation; others
    TorchRec's planner takes, such as enumerator or proposer, have no meaning here and are refused
    by Python): a TorchRec `Topology` (or ours, with its hardware) gives the world and local world
    sizes, the compute device, the per-device HBM cap and the intra/inter-host bandwidths, over the
    hardware preset (`hardware`: a preset name, a hardware file's path such as one written by
    `python -m embark_torchrec.calibrate`, or a Hardware); a storage reservation's `_percentage` of
    HBM is kept free. batch_size is the per-rank batch, as in torchrec. Without `hardware`, the
    preset follows the device in use: cpu-gloo on CPU, the preset matching the GPU's name on CUDA
    (dgx-h100 with a warning naming the GPU when none matches).
    `plans` keeps the Plan of every planned module (by its path) for report() and the plan file,
    each scored alone. Every EmbeddingBagCollection and EmbeddingCollection whose sharder is given
    (as in TorchRec's planner: only those) is planned in one search; an EmbeddingCollection's
    tables (sequence tables) run on EmbarkEmbeddingCollectionSharder. `progress`: a line on stderr while a plan
    takes more than a few seconds; None (default) on rank 0 when its stderr is a terminal (under
    torchrun, collective_plan plans on rank 0 alone: one line), True on every rank that plans,
    False never.
    """

    def __init__(
        self,
        topology: Any = None,
        batch_size: int = 512,
        constraints: Mapping[str, Any] | None = None,
        storage_reservation: Any = None,
        world_size: int | None = None,
        local_world_size: int | None = None,
        hardware: str | Hardware | None = None,
        compute_device: str | None = None,
        id_distribution: IdDistribution | None = None,
        config: SearchConfig | None = None,
        optimizer: OptimizerMemory | None = None,
        measured: ModelSpec | None = None,
        progress: bool | None = None,
    ) -> None:
        if isinstance(topology, Topology):  # ours: its hardware is the plan's, unless given
            hardware = hardware if hardware is not None else topology.hardware
            world_size = world_size or topology.world_size
            local_world_size = local_world_size or topology.local_world_size
            topology = None
        self.world_size = world_size or (topology.world_size if topology is not None else None)
        self.local_world_size = local_world_size or (topology.local_world_size if topology is not None else None)
        self.batch_size = batch_size
        self.torchrec_constraints = dict(constraints or {})
        device = compute_device or (topology.compute_device if topology is not None else None)
        self.compute_device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        chosen = hardware if hardware is not None else default_hardware(self.compute_device)
        base = resolve_hardware(chosen)  # a Hardware, a preset name, or a hardware file's path
        self.hardware = hardware_from_torchrec(base, topology, storage_reservation)
        self.id_distribution = id_distribution
        self.config = config or SearchConfig()
        self.optimizer = optimizer
        self.measured = measured
        self.progress = progress
        self.plans: dict[str, PlannedModel] = {}

    def _topology(self) -> Topology:
        import torch.distributed as dist

        ws = self.world_size or (
            dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        )
        lws = self.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", str(ws)))
        return Topology(ws, lws, self.hardware)

    def _progress(self) -> bool | None:
        """plan_model's progress: as asked, or by default on rank 0 only (None: when its stderr is a terminal)."""
        if self.progress is not None:
            return self.progress
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        return None if rank == 0 else False

    def _modules(self, module: Any, sharders: list[Any], topology: Topology) -> list[_Planned]:
        """The collections the sharders shard (as TorchRec's planner, only those), outermost first,
        each with its spec (measured values applied) and its tables' names in the joint spec."""
        found: list[tuple[str, Any, ModelSpec, bool]] = []
        for path, sub in module.named_modules():
            if any(path.startswith(f"{p}.") for p, *_ in found) or not _sharders_accept(sub, sharders):
                continue  # DistributedModelParallel shards a planned module whole, its children with it
            collection = _collection(sub)
            if collection is None:
                continue
            spec = ModelSpec.from_module(
                collection,
                self.torchrec_constraints,
                batch_size=self.batch_size * topology.world_size,
                name=path or "model",
                id_distribution=self.id_distribution,
                rank_batch_size=self.batch_size,
            )
            if self.measured is not None:
                spec = spec.with_measured(self.measured)
            found.append((path, sub, spec, collection is not sub))
        names = _planned_names([(path, spec) for path, _, spec, _ in found])
        return [_Planned(path, sub, spec, n, mc) for (path, sub, spec, mc), n in zip(found, names)]

    def _constraints(
        self, m: _Planned, sharders: list[Any], constraints: Mapping[str, TableConstraints], topology: Topology
    ) -> dict[str, TableConstraints]:
        """One module's tables' constraints, by their names in the joint spec: the user's (TorchRec's
        keyed by table name), no grids under a row-wise optimizer, TorchRec's row-wise for managed
        collisions, and no replicated sequence tables on CPU (TorchRec's dense sequence kernel there
        ignores its pooling mode): their allowed ranks are all ranks, which rules out replication."""
        own = {t.name for t in m.spec.tables}
        here = _without_grids(m.module, sharders, own, constraints)
        if m.managed_collisions:  # TorchRec runs them row-wise only
            here = {
                t.name: TableConstraints(layout=_row_wise(t.rows, t.dim, topology.world_size)) for t in m.spec.tables
            }
        if self.compute_device == "cpu":
            for t in m.spec.tables:
                if t.is_sequence:
                    c = here.get(t.name, TableConstraints())
                    here[t.name] = replace(c, ranks=c.ranks or tuple(range(topology.world_size)))
        return {m.names[name]: c for name, c in here.items()}

    def plan(self, module: Any, sharders: list[Any]) -> ShardingPlan:
        from ..sharding.parameter_sharding import module_sharding_plan  # the TorchRec adapter lives with the runtime

        topology = self._topology()
        constraints = from_torchrec(self.torchrec_constraints)
        modules = self._modules(module, sharders, topology)
        if not modules:
            raise ValueError(
                "no module in the model is an EmbeddingBagCollection or EmbeddingCollection that the given sharders "
                "shard"
            )
        planned_tables = {t.name for m in modules for t in m.spec.tables}
        misnamed = sorted(set(constraints) - planned_tables)
        if misnamed:
            raise ValueError(
                f"constraints name tables {misnamed} that no planned module has; its tables: {sorted(planned_tables)}"
            )
        unknown = sorted({t.name for t in self.measured.tables} - planned_tables) if self.measured is not None else []
        if unknown:
            raise ValueError(
                f"measured tables {unknown} are not tables of the planned modules {sorted(planned_tables)}"
            )
        joint = ModelSpec(
            name=", ".join(m.path or "model" for m in modules),
            batch_size=self.batch_size * topology.world_size,
            tables=tuple(replace(t, name=m.names[t.name]) for m in modules for t in m.spec.tables),
            id_distribution=modules[0].spec.id_distribution,
        )
        here = {n: c for m in modules for n, c in self._constraints(m, sharders, constraints, topology).items()}
        planned = plan_model(joint, topology, here, self.config, self.optimizer, self._progress())
        result = ShardingPlan(plan={})
        for m in modules:
            layouts = {t.name: planned.plan[m.names[t.name]] for t in m.spec.tables}
            plan = Plan(
                topology.world_size, topology.local_world_size, layouts, {}, planned.plan.allreduce_precision
            ).with_kinds(m.spec)
            self.plans[m.path] = replace(
                planned,
                spec=m.spec,
                plan=plan,
                cost=CostModel(m.spec, topology, self.optimizer).evaluate(plan),
                clusters={t.name: planned.clusters[m.names[t.name]] for t in m.spec.tables},
            )
            result.plan[m.path] = module_sharding_plan(plan, m.spec, self.compute_device)
        _check_sharders(result, modules, sharders)
        return result

    def report(self) -> str:
        """The plan report of every planned module (per-rank memory, lookups and traffic), titled
        by the module's path; the rank that planned holds them (rank 0 after collective_plan)."""
        if not self.plans:
            raise ValueError(
                "nothing planned yet: call plan() or collective_plan() first (on rank 0 for collective_plan)"
            )
        return "\n\n".join(
            render([ScoredPlan("embark", p.plan, p.cost, p.seconds)], p.topology, path or "model")
            for path, p in self.plans.items()
        )

    def collective_plan(self, module: Any, sharders: list[Any] | None = None, pg: Any = None) -> Any:
        """Rank 0 plans (and keeps the details in `plans`); every rank gets the same ShardingPlan."""
        import torch.distributed as dist
        from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
        from ..sharding.sharder import EmbarkEmbeddingBagCollectionSharder

        sharders = sharders or [EmbarkEmbeddingBagCollectionSharder()]
        pg = pg or dist.GroupMember.WORLD
        if pg is None:
            return self.plan(module, sharders)
        return invoke_on_rank_and_broadcast_result(pg, 0, self.plan, module, sharders)
