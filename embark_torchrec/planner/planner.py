"""EmbarkPlanner: a torchrec ShardingPlanner that plans with EMBark's clusters and 3D search.

It wraps `plan_model` (spec + topology -> Plan) for torchrec modules and turns the Plan into the
ShardingPlan that DistributedModelParallel takes (parameter_sharding.py). Every
EmbeddingBagCollection (pooled tables) and EmbeddingCollection (sequence tables) that a given sharder
shards is planned in one search: their tables share the ranks' memory, lookups and links.
"""

from __future__ import annotations

import difflib
import logging
import os
import pickle
from dataclasses import dataclass, replace
import warnings
from typing import Any, Mapping

import torch
from torchrec.distributed.types import ShardingPlan, ShardingPlanner

from ..plan.layout.constraints import TableConstraints, from_torchrec
from ..plan.cost.model import CostModel, OptimizerMemory
from ..plan.model.fields import FieldError, boolean, choice, integer, reading, shown
from ..plan.layout.groups import ShardingGroup
from ..plan.layout.tables import Plan, PlanError, TableLayout
from ..plan.layout.torchrec_types import ceil_row_bounds
from ..plan.report import ScoredPlan, render
from ..plan.plan_model import PlannedModel, plan_model
from ..plan.model.ranges import MAX_WORLD_SIZE, planned_world_size_refusal
from ..plan.search.config import SearchConfig
from ..plan.model.spec import IdDistribution, ModelSpec, SpecError, module_tables
from ..plan.model.hardware_file import hardware_sources, resolve_hardware
from ..plan.model.topology import (
    COMPUTE_DEVICES,
    CPU_HARDWARE,
    DEFAULT_HARDWARE,
    Hardware,
    Topology,
    hardware_preset,
)
from ..sharding.sharded_ec import EmbarkEmbeddingCollectionSharder
from ..sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from ..sharding.torchrec_compat import (
    has_rowwise_state,
    in_backward_optimizers,
    managed_collision_embeddings,
    storage_reservation_share,
)
from .parameter_sharding import module_sharding_plan
from .torchrec_plans import torchrec_default_plan


logger = logging.getLogger(__name__)

TORCHREC_DEFAULT = "torchrec"  # the candidate name of TorchRec's default plan (PlannedModel.source)
# the candidate name of TorchRec's default plan on the device preset's figures: what TorchRec's planner gives a job
# that has no hardware file (the example's --planner torchrec without --hardware)
TORCHREC_PRESET = "torchrec-preset"
TORCHREC_CANDIDATE_WORK = 512  # tables x ranks up to which plan() compares TorchRec's plan by default (on CUDA)

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
        percentage = float(storage_reservation_share(storage_reservation))
        overrides["hbm_reserve_gb"] = percentage * overrides.get("hbm_gb", base.hbm_gb)
    return base.with_overrides(**overrides) if overrides else base


def _check_sharders(result: Any, modules: list["_Planned"], sharders: list[Any]) -> None:
    """Refuses, before any module is sharded, a plan that uses our sharding types on a module whose
    given sharders cannot run them (TorchRec's own would fail deep inside DistributedModelParallel)."""
    for m in modules:
        needed = (
            EmbarkEmbeddingCollectionSharder if m.spec.tables[0].is_sequence else EmbarkEmbeddingBagCollectionSharder
        )
        if any(isinstance(s, needed) for s in sharders if isinstance(m.module, s.module_type)):
            continue
        ours = [
            f"{m.path or 'model'}.{table}"
            for table, ps in result.plan[m.path].items()
            if ShardingGroup.parse(ps.sharding_type).torchrec_type is None
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
    or the one inside a managed-collision module (None for other modules)."""
    inner = managed_collision_embeddings(module)
    if inner is not None:
        return inner
    return module if hasattr(module, "embedding_bag_configs") or hasattr(module, "embedding_configs") else None


def _sharder_for(module: Any) -> str:
    """The sharder that shards this kind of collection with our sharding types, as a user writes it."""
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )

    if isinstance(module, ManagedCollisionEmbeddingBagCollection):
        return "EmbarkManagedCollisionEmbeddingBagCollectionSharder()"
    if isinstance(module, ManagedCollisionEmbeddingCollection):
        return "EmbarkManagedCollisionEmbeddingCollectionSharder()"
    sequence = hasattr(_collection(module), "embedding_configs")
    return "EmbarkEmbeddingCollectionSharder()" if sequence else "EmbarkEmbeddingBagCollectionSharder()"


@dataclass(frozen=True)
class _Found:
    """A table collection in the model: its path, the module a sharder would shard (the collection, or
    the managed-collision module around it), the collection, and whether a given sharder shards it."""

    path: str
    module: Any
    collection: Any
    planned: bool

    @property
    def tables(self) -> list[str]:
        return [cfg.name for cfg in module_tables(self.collection)[0]]

    def described(self) -> str:
        where = f"at {self.path!r}" if self.path else "(the model itself)"
        return f"{type(self.module).__name__} {where} (sharded by {_sharder_for(self.module)})"


def _found(module: Any, sharders: list[Any]) -> list[_Found]:
    """Every table collection in the model, outermost first, planned where a given sharder shards it
    (as TorchRec's planner: a sharded module's children go with it; an unsharded module's children are
    looked at, so the collection inside a managed-collision module no sharder takes is planned if one
    takes it alone)."""
    by_collection: dict[int, _Found] = {}
    for path, sub in module.named_modules():
        if any(path.startswith(f"{f.path}.") for f in by_collection.values() if f.planned):
            continue  # DistributedModelParallel shards a planned module whole, its children with it
        collection = _collection(sub)
        if collection is None:
            continue
        accepted = _sharders_accept(sub, sharders)
        if accepted or id(collection) not in by_collection:
            by_collection[id(collection)] = _Found(path, sub, collection, accepted)
    return list(by_collection.values())


def _nothing_planned(found: list[_Found], sharders: list[Any]) -> ValueError:
    """The error for a model none of whose modules the sharders shard: what it has, and which sharder
    would take each."""
    given = [type(s).__name__ for s in sharders]
    if not found:
        return ValueError(
            "no module in the model is an EmbeddingBagCollection or EmbeddingCollection (or a managed-collision "
            f"one) that the given sharders {given} shard: the model has none"
        )
    listed = "; ".join(f.described() for f in found[:5]) + (" ..." if len(found) > 5 else "")
    return ValueError(
        f"no module in the model is one the given sharders {given} shard; the model has {listed}: pass that sharder "
        "to the planner and to DistributedModelParallel(sharders=[...])"
    )


def _unknown_tables_text(names: list[str], model_tables: set[str]) -> str:
    """What to say of constraints on tables the model does not have, with the nearest names it has
    (the strict planner's error and the lenient one's warning say the same)."""
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, sorted(model_tables), n=1)
        if close:
            hints.append(f"{name!r}: did you mean {close[0]!r}?")
    hint = "; ".join(hints) if hints else f"its tables: {sorted(model_tables)[:20]}"
    return f"constraints name tables {names} that no module of the model has ({hint})"


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


def _asked_grid(raw: Any, c: TableConstraints) -> str | None:
    """How a table's constraints ask for a row x column grid (TorchRec's grid_shard alone, our fewest
    slices or a forced layout), or None when they do not."""
    if c.layout is not None and c.layout.num_row_slices > 1 and c.layout.num_col_slices > 1:
        return f"a layout of {c.layout.num_row_slices} x {c.layout.num_col_slices} slices"
    if c.min_cuts[0] > 1 and c.min_cuts[1] > 1:
        types = getattr(raw, "sharding_types", None)
        return f"sharding_types {list(types)}" if types is not None else f"min_cuts {c.min_cuts}"
    return None


def _without_grids(
    module: Any,
    sharders: list[Any],
    names: set[str],
    constraints: Mapping[str, TableConstraints],
    raw: Mapping[str, Any],
) -> dict[str, TableConstraints]:
    """`constraints` for the module's tables, forbidding row x column grids when the fused optimizer
    (the sharder's, or one apply_optimizer_in_backward gave its parameters) keeps per-row state
    (TorchRec's fused optimizer cannot lay that state out for them; see
    torchrec_compat.has_rowwise_state); a table whose constraints (`raw`: as the user gave them) ask
    for a grid then is a PlanError naming the table, the optimizer and what to change, at plan time
    rather than when DistributedModelParallel shards it."""
    here = {k: v for k, v in constraints.items() if k in names}
    given = [(s.fused_params or {}).get("optimizer") for s in sharders if isinstance(module, s.module_type)]
    optimizers = [(o, "the sharder's fused_params") for o in given]
    optimizers += [(o, "apply_optimizer_in_backward") for o in in_backward_optimizers(module)]
    rowwise = next(((o, source) for o, source in optimizers if has_rowwise_state(o)), None)
    if rowwise is None:
        return here
    optimizer, source = rowwise
    for name, c in here.items():
        asked = _asked_grid(raw.get(name), c)
        if asked is not None:
            raise PlanError(
                f"its constraints ask for a row x column grid ({asked}), but its optimizer "
                f"{getattr(optimizer, 'name', optimizer)} (from {source}) keeps per-row state, which TorchRec's fused "
                "optimizer cannot lay out for such a grid: list 'row_wise' or 'column_wise' in its sharding_types "
                "instead of 'grid_shard', or train it with an optimizer without per-row state (EXACT_ADAGRAD, "
                "EXACT_SGD)",
                where=f"table {name!r}",
            )
    return {n: replace(here.get(n, TableConstraints()), grid_cuts=False) for n in names}


def _check_arguments(
    topology: Any,
    batch_size: Any,
    constraints: Any,
    storage_reservation: Any,
    world_size: Any,
    local_world_size: Any,
    compute_device: Any,
    typed: Mapping[str, Any],
    flags: Mapping[str, Any],
) -> None:
    """EmbarkPlanner's arguments checked as a file's fields are, by type and range, each refused by
    name (a SpecError): a world size of 0 would plan for the environment's, a batch_size of True for
    a batch of 1, a plain dict of constraints would be read as no constraint at all. `typed`: the
    arguments that are None or one of our types (IdDistribution, SearchConfig, ...); `flags`: those
    that are None or a bool (progress, torchrec_candidate)."""
    from torchrec.distributed.planner.types import ParameterConstraints, StorageReservation
    from torchrec.distributed.planner.types import Topology as TorchrecTopology

    kinds = {
        "id_distribution": IdDistribution,
        "config": SearchConfig,
        "optimizer": OptimizerMemory,
        "measured": ModelSpec,
    }
    with reading(SpecError, where="EmbarkPlanner"):
        if topology is not None and not isinstance(topology, (TorchrecTopology, Topology)):
            raise FieldError(f"expected a TorchRec or an embark Topology, got {shown(topology)}", "topology")
        integer(batch_size, "batch_size", minimum=1)
        sizes = {"world_size": world_size, "local_world_size": local_world_size}
        for name, value in sizes.items():
            if value is None:
                continue
            integer(value, name, minimum=1, maximum=MAX_WORLD_SIZE)
            given = getattr(topology, name, value)
            if given != value:
                raise FieldError(f"{value} contradicts the topology's {name} {given}; give one of them", name)
        world = world_size or getattr(topology, "world_size", None)
        local = local_world_size or getattr(topology, "local_world_size", None)
        too_many = planned_world_size_refusal(world) if isinstance(world, int) else None
        if too_many is not None:
            raise FieldError(too_many, "world_size")
        if world is not None and local is not None and world % local:
            raise FieldError(f"{local} does not divide the world size {world} into nodes", "local_world_size")
        device = compute_device if compute_device is not None else getattr(topology, "compute_device", None)
        if device is not None:
            choice(
                device, "compute_device" if compute_device is not None else "topology.compute_device", COMPUTE_DEVICES
            )
        if storage_reservation is not None:
            if not isinstance(storage_reservation, StorageReservation):
                raise FieldError(
                    f"expected a TorchRec StorageReservation, got {shown(storage_reservation)}", "storage_reservation"
                )
            share = storage_reservation_share(storage_reservation)
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share < 1.0:
                raise FieldError(f"expected a share of memory in [0, 1), got {shown(share)}", "storage_reservation")
        for name, value in flags.items():
            if value is not None:
                boolean(value, name)
        for name, value in typed.items():
            if value is not None and not isinstance(value, kinds[name]):
                raise FieldError(f"expected a {kinds[name].__name__}, got {shown(value)}", name)
        if constraints is None:
            return
        if not isinstance(constraints, Mapping):
            raise FieldError(
                f"expected a mapping of table names to ParameterConstraints, got {shown(constraints)}", "constraints"
            )
        for table, c in constraints.items():
            if not isinstance(table, str) or not table:
                raise FieldError(f"expected table names (non-empty strings) as keys, got {shown(table)}", "constraints")
            if not isinstance(
                c, (ParameterConstraints, TableConstraints, Mapping)
            ):  # a Mapping: from_torchrec says why
                raise FieldError(
                    f"expected a TorchRec ParameterConstraints or an embark TableConstraints, got {shown(c)}",
                    where=f"table {table!r}",
                )


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
    (as in TorchRec's planner: only those; managed-collision ones too, row-wise) is planned in one search;
    an EmbeddingCollection's tables (sequence tables) run on EmbarkEmbeddingCollectionSharder. Every
    argument is checked when the planner is made (SpecErrors naming it), constraints included; constraints
    on tables of modules no given sharder shards are logged and left alone, and so are constraints on
    tables the model lacks (as TorchRec's planner ignores them), with a did-you-mean in one warning;
    `strict_constraints=True` refuses those instead (a SpecError naming them and the nearest names).
    `progress`: a line on stderr while a plan takes more than a few seconds; None (default) on rank 0
    when its stderr is a terminal (under torchrun, collective_plan plans on rank 0 alone: one line),
    True on every rank that plans, False never.
    `torchrec_candidate`: whether plan() also runs TorchRec's own EmbeddingShardingPlanner (its
    default options, with the sharders plan() is given, on the same tables, batch and hardware figures: the plan
    the job would run under TorchRec's planner; where the figures are not the device's preset, once more on the
    preset's, the plan TorchRec's planner gives a job without a hardware file) and passes its plans to plan_model as
    candidates, the cheaper the incumbent: plan_model returns it unless our plan is predicted faster by more than
    the cost model's measured error on plan differences on this hardware (Hardware.speedup_band, from a hardware
    file; 0, not measured, for the presets: then any predicted gain counts), and report() says which way it
    went. TorchRec's planner takes seconds to minutes (on this project's CPU box: 8 s for DCNv2's 26 tables at
    16 ranks, 65 s at 128, over 5 minutes for 177 tables at 16), so None (default) runs it where the hardware
    has a measured error on plan differences, or on CUDA when tables x world size is at most
    TORCHREC_CANDIDATE_WORK; True always, False never. A failure of TorchRec's planner is logged, and the search's
    plan stands.
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
        torchrec_candidate: bool | None = None,
        strict_constraints: bool = False,
    ) -> None:
        _check_arguments(
            topology,
            batch_size,
            constraints,
            storage_reservation,
            world_size,
            local_world_size,
            compute_device,
            {"id_distribution": id_distribution, "config": config, "optimizer": optimizer, "measured": measured},
            {"progress": progress, "torchrec_candidate": torchrec_candidate, "strict_constraints": strict_constraints},
        )
        if isinstance(topology, Topology):  # ours: its hardware is the plan's, unless given
            hardware = hardware if hardware is not None else topology.hardware
            world_size = world_size or topology.world_size
            local_world_size = local_world_size or topology.local_world_size
            topology = None
        self.world_size = world_size or (topology.world_size if topology is not None else None)
        self.local_world_size = local_world_size or (topology.local_world_size if topology is not None else None)
        self.batch_size = batch_size
        self.torchrec_constraints = dict(constraints or {})
        self.table_constraints = from_torchrec(self.torchrec_constraints)  # refused now, not when planning
        device = compute_device or (topology.compute_device if topology is not None else None)
        self.compute_device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        chosen = hardware if hardware is not None else default_hardware(self.compute_device)
        base = resolve_hardware(chosen)  # a Hardware, a preset name, or a hardware file's path
        self.hardware = hardware_from_torchrec(base, topology, storage_reservation)
        self.hardware_sources = hardware_sources(chosen)  # a hardware file's measured figures, for the report
        self.id_distribution = id_distribution
        self.config = config or SearchConfig()
        self.optimizer = optimizer
        self.measured = measured
        self.progress = progress
        self.torchrec_candidate = torchrec_candidate
        self.strict_constraints = strict_constraints
        self.plans: dict[str, PlannedModel] = {}

    def _topology(self) -> Topology:
        import torch.distributed as dist

        ws = self.world_size or (
            dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        )
        lws = self.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", str(ws)))
        too_many = planned_world_size_refusal(ws)
        if too_many is not None:  # the job's own world size, read here (the arguments' was checked on construction)
            raise SpecError(f"EmbarkPlanner: {too_many}")
        return Topology(ws, lws, self.hardware)

    def _progress(self) -> bool | None:
        """plan_model's progress: as asked, or by default on rank 0 only (None: when its stderr is a terminal)."""
        if self.progress is not None:
            return self.progress
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        return None if rank == 0 else False

    def _modules(self, found: list[_Found], topology: Topology) -> list[_Planned]:
        """The collections the sharders shard (as TorchRec's planner, only those), outermost first,
        each with its spec (measured values applied) and its tables' names in the joint spec."""
        planned: list[tuple[_Found, ModelSpec]] = []
        for f in found:
            if not f.planned:
                continue
            spec = ModelSpec.from_module(
                f.collection,
                self.torchrec_constraints,
                batch_size=self.batch_size * topology.world_size,
                name=f.path or "model",
                id_distribution=self.id_distribution,
                rank_batch_size=self.batch_size,
            )
            if self.measured is not None:
                spec = spec.with_measured(self.measured)
            planned.append((f, spec))
        names = _planned_names([(f.path, spec) for f, spec in planned])
        return [
            _Planned(f.path, f.module, spec, n, f.collection is not f.module) for (f, spec), n in zip(planned, names)
        ]

    def _constraints(self, m: _Planned, sharders: list[Any], topology: Topology) -> dict[str, TableConstraints]:
        """One module's tables' constraints, by their names in the joint spec: the user's (TorchRec's
        keyed by table name), no grids under a row-wise optimizer, TorchRec's row-wise for managed
        collisions, and no replicated sequence tables on CPU (TorchRec's dense sequence kernel there
        ignores its pooling mode): their allowed ranks are all ranks, which rules out replication."""
        own = {t.name for t in m.spec.tables}
        here = _without_grids(m.module, sharders, own, self.table_constraints, self.torchrec_constraints)
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

    def _torchrec_candidates(self, joint: ModelSpec, topology: Topology, sharders: list[Any]) -> dict[str, Plan]:
        """TorchRec's default plans of the joint spec with the job's sharders, by name, when asked for (see
        torchrec_candidate): on this planner's figures and, where those are not the device's preset, on the preset's,
        as TorchRec's planner plans a job without a hardware file; the cheaper of the two is the incumbent, so that
        the plan returned is never priced slower than either TorchRec plan the user would otherwise run."""
        wanted = self.torchrec_candidate
        if wanted is None:  # the hardware's measured error decides against TorchRec's plan: it must be at hand
            wanted = topology.hardware.plan_error_measured or (
                self.compute_device == "cuda" and len(joint.tables) * topology.world_size <= TORCHREC_CANDIDATE_WORK
            )
        if not wanted:
            return {}
        with warnings.catch_warnings():  # an unknown GPU is the constructor's to warn of, where it takes a preset
            warnings.simplefilter("ignore")
            preset = hardware_preset(default_hardware(self.compute_device))
        figures = {TORCHREC_DEFAULT: topology}
        if preset != topology.hardware:
            figures[TORCHREC_PRESET] = Topology(topology.world_size, topology.local_world_size, preset)
        out = {}
        for name, on in figures.items():
            try:
                out[name] = torchrec_default_plan(joint, on, self.compute_device, sharders)
            except Exception as e:  # noqa: BLE001  TorchRec's planner failing leaves the search's plan
                logger.warning(
                    "TorchRec's planner found no %s plan to compare with (%s: %s)", name, type(e).__name__, e
                )
        return out

    def _check_names(self, found: list[_Found]) -> None:
        """Constraints and measured tables name tables of this call's modules. Constraints on tables of
        the model's other modules (no given sharder shards them) are left alone, as TorchRec's planner
        leaves them (its test harness passes one set for a whole model to planners of parts of it),
        and logged once. A name no module of the model has is ignored as TorchRec's planner ignores it
        (its tests build constraints from full table lists for models with fewer tables), with one
        warning naming the nearest names, as it may be a typo; strict_constraints refuses it instead."""
        model_tables = {t for f in found for t in f.tables}
        planned_tables = {t for f in found if f.planned for t in f.tables}
        unknown = sorted(set(self.torchrec_constraints) - model_tables)
        if unknown and self.strict_constraints:
            raise SpecError(_unknown_tables_text(unknown, model_tables))
        if unknown:
            text = _unknown_tables_text(unknown, model_tables)
            logger.warning("%s: ignored, as TorchRec's planner ignores them", text)
        elsewhere = sorted(set(self.torchrec_constraints) - planned_tables - set(unknown))
        if elsewhere:
            unplanned = "; ".join(f.described() for f in found if not f.planned and set(f.tables) & set(elsewhere))
            logger.warning(
                "constraints on tables %s left unused: no given sharder shards their modules (%s)", elsewhere, unplanned
            )
        measured = sorted({t.name for t in self.measured.tables} - planned_tables) if self.measured is not None else []
        if measured:
            raise ValueError(
                f"measured tables {measured} are not tables of the planned modules {sorted(planned_tables)}"
            )

    def plan(self, module: Any, sharders: list[Any]) -> ShardingPlan:
        topology = self._topology()
        found = _found(module, sharders)
        modules = self._modules(found, topology)
        if not modules:
            raise _nothing_planned(found, sharders)
        self._check_names(found)
        joint = ModelSpec(
            name=", ".join(m.path or "model" for m in modules),
            batch_size=self.batch_size * topology.world_size,
            tables=tuple(replace(t, name=m.names[t.name]) for m in modules for t in m.spec.tables),
            id_distribution=modules[0].spec.id_distribution,
        )
        here = {n: c for m in modules for n, c in self._constraints(m, sharders, topology).items()}
        candidates = self._torchrec_candidates(joint, topology, sharders)
        incumbent = tuple(candidates) or None
        planned = plan_model(
            joint, topology, here, self.config, self.optimizer, self._progress(), candidates, incumbent
        )
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
            render(
                [ScoredPlan(p.source, p.plan, p.cost, p.seconds)], p.topology, path or "model", self.hardware_sources
            )
            + ("" if p.choice is None else f"\n\n{p.choice.sentence()}")
            for path, p in self.plans.items()
        )

    def collective_plan(self, module: Any, sharders: list[Any] | None = None, pg: Any = None) -> Any:
        """Rank 0 plans (and keeps the details in `plans`); every rank gets the same ShardingPlan, or
        raises the same error: rank 0 broadcasts what planning gave, the plan or its exception, in the
        one broadcast there is anyway (were it to raise alone, the other ranks would wait in the
        broadcast until their peer's connection closed, an error that names nothing)."""
        import torch.distributed as dist

        sharders = sharders or [EmbarkEmbeddingBagCollectionSharder()]
        pg = pg or dist.GroupMember.WORLD
        if pg is None or pg.size() == 1:
            return self.plan(module, sharders)
        outcome: list[Any] = [None]
        error: Exception | None = None
        if pg.rank() == 0:
            try:
                outcome[0] = ("plan", self.plan(module, sharders))
            except Exception as exc:  # noqa: BLE001 - every rank raises it below
                error, outcome[0] = exc, ("error", _portable(exc))
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(pg, 0), group=pg)
        kind, value = outcome[0]
        if kind == "plan":
            return value
        if error is not None:
            raise error
        value.add_note("raised by rank 0, which planned for every rank")
        raise value


def _portable(exc: Exception) -> Exception:
    """`exc` as the other ranks can raise it: itself when it survives pickling with its class and
    message, else a RuntimeError with both."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc) and str(copy) == str(exc):
            return exc
    except Exception:  # noqa: BLE001 - any exception that cannot cross is sent as its text
        pass
    return RuntimeError(f"{type(exc).__name__}: {exc}")
