"""load_plan: a plan file into the ShardingPlan that DistributedModelParallel takes."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from ..plan.model.fields import FieldError, choice, integer, number, reading, shown
from ..plan.layout.tables import Plan, PlanError
from ..plan.model.topology import COMPUTE_DEVICES
from ..plan.model.spec import ModelSpec, module_tables
from .parameter_sharding import module_sharding_plan

# the collections a plan file lays out: pooled tables (EmbeddingBagCollection), sequence tables (EmbeddingCollection)
_COLLECTIONS = (EmbeddingBagCollection, EmbeddingCollection)


def load_plan(
    plan: str | Path | Mapping[str, Any] | Plan,
    module: torch.nn.Module,
    world_size: int | None = None,
    compute_device: str | None = None,
    local_world_size: int | None = None,
    memory_cap_bytes: float | None = None,
) -> ShardingPlan:
    """Match the plan's tables by name to the EmbeddingBagCollections and EmbeddingCollections in
    `module` (nested ones too; one plan file may hold both kinds of tables).

    Refused with a PlanError naming the file (when given one), the module path and the table: a
    world size other than `world_size` (default: the initialised process group's), nodes of another
    size than `local_world_size` (default, with a process group: TorchRec's, get_local_size, which its
    intra-node groups and our hierarchical reduction use: LOCAL_WORLD_SIZE as torchrun sets it), a table
    the module lacks or a module table the plan lacks, a table named in two collections, a table the
    plan records as another kind (sequence / pooled) than its collection's, layouts that do not tile
    the module's tables exactly, a data-parallel table at a precision DDP would not run it at
    (Plan.check_replicated_precision: fp8, or other than the plan's allreduce_precision), and a rank
    whose embedding weights alone exceed `memory_cap_bytes` (default: the compute device's memory, a
    GPU's total or this host's on CPU), naming the rank, its
    largest table and the sizes. Optimizer state is not counted (the sharder's optimizer is not known
    here), so a plan that passes may still not fit; one that fails cannot.
    """
    file = "" if isinstance(plan, (Mapping, Plan)) else str(plan)
    if isinstance(plan, Plan):
        loaded = plan
    elif isinstance(plan, Mapping):
        loaded = Plan.from_dict(plan)
    else:
        loaded = Plan.load(plan)
    with reading(PlanError, file=file):
        return _sharding_plan(loaded, module, world_size, compute_device, local_world_size, memory_cap_bytes)


def _sharding_plan(
    loaded: Plan,
    module: torch.nn.Module,
    world_size: int | None,
    compute_device: str | None,
    local_world_size: int | None,
    memory_cap_bytes: float | None,
) -> ShardingPlan:
    """load_plan once the plan is read; errors name the module path of the table at fault."""
    with reading(PlanError, where="load_plan"):  # the arguments, checked as a file's fields are
        if not isinstance(module, torch.nn.Module):
            raise FieldError(f"expected the torch.nn.Module to shard, got {shown(module)}", "module")
        if world_size is not None:
            integer(world_size, "world_size", minimum=1)
        if compute_device is not None:
            choice(compute_device, "compute_device", COMPUTE_DEVICES)
    expected_ws = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else None)
    if expected_ws is not None and loaded.world_size != expected_ws:
        raise PlanError(f"the plan is for world size {loaded.world_size}, but this job has {expected_ws} ranks")
    _check_node_size(loaded, local_world_size)
    loaded.check_replicated_precision()
    device = compute_device or ("cuda" if torch.cuda.is_available() else "cpu")
    owners: dict[str, str] = {}
    collections = [(path, m) for path, m in module.named_modules() if isinstance(m, _COLLECTIONS)]
    if not collections:
        raise PlanError("the module has no EmbeddingBagCollection or EmbeddingCollection to apply the plan to")
    result = ShardingPlan(plan={})
    memory = _RankMemory(loaded.world_size)
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
        memory.add(sub, collection)
        result.plan[path] = module_sharding_plan(sub, spec, device)
    extra = sorted(set(loaded.tables) - set(owners))
    if extra:
        raise PlanError(f"the plan lays out tables {extra} that the module does not have")
    memory.check(memory_cap_bytes, device)
    return result


def _check_node_size(loaded: Plan, local_world_size: int | None) -> None:
    """The plan's nodes against the job's: given, else TorchRec's (get_local_size) once a process group is up."""
    if local_world_size is not None:
        with reading(PlanError):
            expected, source = integer(local_world_size, "local_world_size", minimum=1), "as given"
    elif dist.is_initialized():
        try:
            expected = get_local_size(dist.get_world_size())
        except ValueError:  # LOCAL_WORLD_SIZE (or MPI's) set to something that is not a number
            env = os.environ.get("LOCAL_WORLD_SIZE")
            raise PlanError(f"this job's LOCAL_WORLD_SIZE {env!r} is not an integer") from None
        source = "LOCAL_WORLD_SIZE, as TorchRec's get_local_size reads it"
    else:
        return
    if loaded.local_world_size != expected:
        raise PlanError(
            f"the plan is for nodes of {loaded.local_world_size} ranks (local_world_size), but this job's nodes "
            f"have {expected} ({source}); plan again for this job's nodes"
        )


class _RankMemory:
    """Bytes of embedding weights each rank holds under a plan: its cells, and every data-parallel table whole."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.cells: dict[tuple[int, str], float] = defaultdict(float)  # (rank, table) -> bytes
        self.replicated: dict[str, float] = {}  # data-parallel table -> bytes, on every rank

    def add(self, plan: Plan, collection: torch.nn.Module) -> None:
        configs, _ = module_tables(collection)
        for cfg in configs:
            element = DATA_TYPE_NUM_BITS[cfg.data_type] / 8
            layout = plan[cfg.name]
            if layout.kind.replicated:
                self.replicated[cfg.name] = cfg.num_embeddings * cfg.embedding_dim * element
                continue
            for s in layout.shards():
                self.cells[(s.rank, cfg.name)] += (s.rows[1] - s.rows[0]) * (s.cols[1] - s.cols[0]) * element

    def check(self, cap_bytes: float | None, device: str) -> None:
        """Refuses, naming it, the rank holding the most when that is over the cap (default: the device's memory)."""
        if cap_bytes is not None:
            with reading(PlanError):
                cap, what = number(cap_bytes, "memory_cap_bytes"), "memory_cap_bytes"
        else:
            known = _device_memory(device)
            if known is None:
                return
            cap, what = known
        replicated = sum(self.replicated.values())
        per_rank = [replicated] * self.world_size
        for (rank, _), size in self.cells.items():
            per_rank[rank] += size
        over = [k for k, used in enumerate(per_rank) if used > cap]
        if not over:
            return
        rank = max(over, key=lambda k: per_rank[k])
        held = {**self.replicated}
        for (k, table), size in self.cells.items():
            if k == rank:
                held[table] = size
        table, largest = max(held.items(), key=lambda item: item[1])
        others = f" ({len(over)} ranks are over it)" if len(over) > 1 else ""
        raise PlanError(
            f"rank {rank} would hold {per_rank[rank] / 1e9:.2f} GB of embedding weights, more than the "
            f"{cap / 1e9:.2f} GB it may hold ({what}){others}; its largest table there is {table!r} "
            f"({largest / 1e9:.2f} GB on that rank)"
        )


def _device_memory(device: str) -> tuple[float, str] | None:
    """The memory one rank may at most hold on `device`, and where that figure comes from: a GPU's total memory,
    this host's physical memory on CPU; None where it is not known (another device type, no CUDA)."""
    d = torch.device(device)
    if d.type == "cuda" and torch.cuda.is_available():
        index = d.index if d.index is not None else torch.cuda.current_device()
        return float(torch.cuda.get_device_properties(index).total_memory), f"cuda:{index}'s memory"
    if d.type == "cpu":
        try:
            return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "this host's memory"
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
            return None
    return None
