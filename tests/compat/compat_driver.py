"""Run TorchRec's own sharding test harness (torchrec.distributed.test_utils, shipped in the wheel) with our sharder
and planner, many configurations inside one group of gloo ranks.

Why: TorchRec's harness is how TorchRec checks its own sharder; passing it with ours, wherever TorchRec's own sharder
passes it, is the compatibility claim. TorchRec's harness spawns one process group per configuration (seconds each
for the torchrec import); here one spawned group runs a whole list of cases, each checked two ways:

* ``harness``: TorchRec's ``sharding_single_rank_test_single_process`` itself (SGD only, as TorchRec asserts): its
  TestSparseNN, its inputs, its training step and its prediction comparison with the unsharded model, at its
  tolerances. Its planner is hard-coded, so while it runs, ``EmbeddingShardingPlanner`` in its module is rebound to
  one that hands back the case's plan (made beforehand, the same for both sharders).
* ``driver``: the harness's own pieces (``gen_model_and_input``, ``copy_state_dict``, ``alter_global_ebc_dtype``,
  TestSparseNN and ModelInput's generators) for what the harness cannot check: STEPS steps with the fused optimizer
  under test (SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD) against an unsharded reference, comparing at every step the
  loss, the training predictions and the dense gradients, then the evaluation predictions and every weight, shard by
  shard, at the harness's tolerances, and the fused optimizer's state as its state_dict (a checkpoint) holds it.

``test_sharding.py`` imports ``TestEmbeddingCollectionSharder`` from ``torchrec.distributed.tests``, which the wheel
does not ship; the harness builds it only for 2D-parallel ``submodule_configs``, which we never pass. A leaf module
holding a placeholder of that name (which refuses to be built) makes the import work.
"""

from __future__ import annotations

import copy
import sys
import time
import traceback
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WORLDS = {2: 2, 4: 2}  # world size -> local world size: one node of 2 ranks, and 2 nodes x 2
LEARNING_RATE = 0.1  # the harness's, for fused and dense parameters
EPS = 1e-8  # fbgemm's Adagrad epsilon, given to both sides
STEPS = 2
BATCH_SIZE = 4  # the harness's default
NUM_FLOAT_FEATURES = 16  # the harness's
QCOMMS_RTOL = 0.003  # the harness's relaxed tolerance under quantized comms, with atol = largest value x rtol
ITP_PREFIX = "sparse.pooled_embedding_arch.embedding_modules._itp_iter"  # the harness's copy exclusion
CASE_TIMEOUT_S = 30.0  # a case's collectives give up after this, so one hung case cannot stall the rest

#: what each option changes, as the harness's arguments do: MEAN-pooled tables, a variable batch per feature (VBE,
#: ``variable_batch_per_feature``), a variable batch per rank (``variable_batch_size``), fp16 QCommsConfig both ways,
#: or the fused optimizer (the others train with SGD)
OPTIONS = ("sum", "mean", "vbe", "vbs", "qcomms", "adagrad", "rowwise")
NOT_RUNNABLE = "not runnable"  # a check's outcome when TorchRec's own sharder is given our sharding types

_MISSING_MODULE = "torchrec.distributed.tests.test_sequence_model"


# ---------------------------------------------------------------- cases and outcomes


@dataclass(frozen=True)
class Case:
    """One configuration: a plan (PLANS), an option (OPTIONS) and a sharder, on a world size."""

    world_size: int
    plan: str
    option: str
    sharder: str  # "embark" (ours) or "torchrec" (TorchRec's own EmbeddingBagCollectionSharder)
    checks: tuple[str, ...] = ("harness", "driver")  # which to run ("harness" only runs with SGD)

    @property
    def name(self) -> str:
        return f"ws{self.world_size}-{self.plan}-{self.option}-{self.sharder}"

    @property
    def optimizer(self) -> str:
        return {"adagrad": "adagrad", "rowwise": "rowwise_adagrad"}.get(self.option, "sgd")


@dataclass
class Outcome:
    """One case on one rank: each check's failure (exception and traceback), or None where it passed."""

    checks: dict[str, str | None] = field(default_factory=dict)
    plan_types: dict[str, str] = field(default_factory=dict)  # table -> sharding type, as the plan has it
    state_shards: int = 0  # shards of fused optimizer state the driver compared on this rank
    seconds: float = 0.0


# ---------------------------------------------------------------- TorchRec's harness, importable


def _install_missing_module() -> None:
    """``torchrec.distributed.tests.test_sequence_model`` with the one name test_sharding.py imports from it."""
    if _MISSING_MODULE in sys.modules:
        return
    module = types.ModuleType(_MISSING_MODULE)

    class TestEmbeddingCollectionSharder:
        """Placeholder: the harness builds it only for 2D-parallel submodule_configs, which we never pass."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError(f"{_MISSING_MODULE} is not in the torchrec wheel (2D-parallel submodule_configs)")

    module.TestEmbeddingCollectionSharder = TestEmbeddingCollectionSharder  # type: ignore[attr-defined]
    sys.modules[_MISSING_MODULE] = module


def harness() -> types.ModuleType:
    """torchrec.distributed.test_utils.test_sharding, imported (rank processes only: the placeholder is global)."""
    _install_missing_module()
    from torchrec.distributed.test_utils import test_sharding

    return test_sharding


@dataclass(frozen=True)
class HarnessTables:
    """The tables of TorchRec's model-parallel tests, as its ModelParallelTestShared builds them."""

    tables: list[Any]
    mean_tables: list[Any]
    weighted_tables: list[Any]
    embedding_groups: dict[str, list[str]]

    def for_case(self, case: Case) -> tuple[list[Any], list[Any] | None]:
        """(tables, weighted tables): MEAN-pooled tables for "mean"; no weighted tables under VBE, as TorchRec's VBE
        tests pass (its VBE input generator gives weighted features no weights)."""
        return (
            self.mean_tables if case.option == "mean" else self.tables,
            None if case.option == "vbe" else self.weighted_tables,
        )


def harness_tables() -> HarnessTables:
    """TorchRec's test tables, made by TorchRec's test class: table_0..3 read feature_0..3, table_4 and table_5 read
    feature_0 and feature_1 again (so their pooled outputs are named ``feature@table``), and 2 weighted tables."""
    harness()
    from torchrec.distributed.test_utils.test_model_parallel import ModelParallelTestShared

    shared = ModelParallelTestShared()
    shared.setUp(backend="gloo")
    shared._build_tables_and_groups()
    torch.use_deterministic_algorithms(False)  # setUp turns it on process-wide; each case sets it as the harness does
    return HarnessTables(shared.tables, shared.mean_tables, shared.weighted_tables, shared.embedding_groups)


# ---------------------------------------------------------------- plans

#: TorchRec's built-in types, each forced on every table through ParameterConstraints (TorchRec's planner)
BUILTIN_TYPES = (
    "data_parallel",
    "table_wise",
    "column_wise",
    "table_column_wise",
    "row_wise",
    "table_row_wise",
    "grid_shard",
)
#: one built-in type per table, all of them used, forced the same way
MIXED_TYPES = {
    "table_0": "table_wise",
    "table_1": "column_wise",
    "table_2": "row_wise",
    "table_3": "table_row_wise",
    "table_4": "data_parallel",
    "table_5": "table_column_wise",
    "weighted_table_0": "grid_shard",
    "weighted_table_1": "row_wise",
}
#: one row-wise table among table-wise ones
RW_TW_TYPES = {name: "table_wise" for name in MIXED_TYPES} | {"table_2": "row_wise"}
CONSTRAINED = {"mixed": MIXED_TYPES, "rw_tw": RW_TW_TYPES}
#: hand-built layouts on our sharding types (see _embark_layouts)
EMBARK_PLANS = ("grid", "grid_cuts", "grid_shared", "hier", "ub", "ub_shared")
#: planners' own plans: TorchRec's (TorchRec's own sharder's types), ours with the device's preset (cpu-gloo: these
#: tiny tables replicated) and with dgx-h100's figures at free collectives and de-duplication (which put them on our UB
#: type at 4 ranks)
PLANNER_PLANS = ("torchrec_planner", "embark_planner", "embark_planner_h100")
#: EmbarkPlanner (dgx-h100's figures, as embark_planner_h100) under TorchRec's examples' constraint patterns, and
#: ub_planned: the hand-built "ub" layouts as constraints; each given, as TorchRec's tests give them, for all 8 of the
#: harness's tables, also where the case's model has fewer (no weighted tables under VBE: the planner ignores the
#: names it lacks, as TorchRec's does; see _example_constraints), planned by collective_plan
EXAMPLE_PLANS = ("dense_kernel", "grid_planned", "ub_mixed", "ub_planned")
PLANS = BUILTIN_TYPES + tuple(CONSTRAINED) + EMBARK_PLANS + PLANNER_PLANS + EXAMPLE_PLANS


def _topology(world_size: int) -> Any:
    from torchrec.distributed.planner import Topology

    return Topology(world_size=world_size, compute_device="cpu", local_world_size=WORLDS[world_size])


def _constraints(plan: str, names: Sequence[str]) -> dict[str, Any]:
    """ParameterConstraints forcing one sharding type per table (min_partition 4: column shards of 4+ columns)."""
    from torchrec.distributed.planner import ParameterConstraints

    def force(kind: str) -> Any:
        kernels = ["dense"] if kind == "data_parallel" else ["fused"]
        return ParameterConstraints(sharding_types=[kind], compute_kernels=kernels, min_partition=4)

    types_by_table = CONSTRAINED.get(plan) or dict.fromkeys(names, plan)
    return {name: force(types_by_table[name]) for name in names}


def _example_constraints(plan: str, names: Sequence[str], world_size: int) -> dict[str, Any]:
    """Constraints for every table `names` lists, each ParameterConstraints(min_partition=4) as TorchRec's VBE
    tests give them, but: dense_kernel: table_2 replicated by compute_kernels=["dense"] (train_dlrm_data_parallel.py's
    way); grid_planned: table_2 on grid_shard; ub_mixed: table_2 and table_3 unique-based (ours), the others on
    TorchRec's table_wise / column_wise; ub_planned: every table's layout of the hand-built "ub" plan."""
    from torchrec.distributed.planner import ParameterConstraints

    from embark_torchrec.plan.layout.constraints import TableConstraints

    out: dict[str, Any] = {n: ParameterConstraints(min_partition=4) for n in names}
    if plan == "ub_planned":
        layouts = _embark_layouts("ub", world_size)
        return {n: TableConstraints(layout=layouts[n]) for n in names}
    if plan == "dense_kernel":
        out["table_2"] = ParameterConstraints(compute_kernels=["dense"])
    elif plan == "grid_planned":
        out["table_2"] = ParameterConstraints(sharding_types=["grid_shard"], min_partition=4)
    else:
        out = {n: ParameterConstraints(sharding_types=["table_wise", "column_wise"], min_partition=4) for n in names}
        out.update({n: TableConstraints(cluster="ub") for n in ("table_2", "table_3")})
    return out


def _embark_layouts(plan: str, world_size: int) -> dict[str, Any]:
    """Hand-built layouts of the harness tables (rows x dims: table_0..5 10x16, 20x24, 30x32, 40x40, 10x16, 20x24;
    weighted_table_0/1 10x8, 20x12) that run on our sharding types (uneven row bounds, so no built-in type fits).

    grid: row x column grids (2 x 2 and 3 x 2) with cells of one table repeated on a rank; grid_cuts: rows cut
    only, several cells of one table on one rank (what row-wise Adagrad allows); grid_shared / ub_shared: the tables
    of the shared features (feature_0: table_0, table_4; feature_1: table_1, table_5) on our types as well; hier:
    partial sums reduced inside each node first; ub: de-duplicated (unique-based) tables. Elsewhere the shared
    features' tables stay table-wise."""
    from embark_torchrec.plan.layout.tables import TableLayout as L

    last = world_size - 1  # on the second node at 4 ranks
    shared_tw = {
        "table_0": L.table_wise(10, 16, 0),
        "table_1": L.table_wise(20, 24, 1),
        "table_4": L.table_wise(10, 16, last),
        "table_5": L.table_wise(20, 24, 0),
    }
    cuts = {
        "table_2": L("rb", (0, 5, 17, 30), (0, 32), ((0,), (last,), (0,))),
        "table_3": L("rb", (0, 7, 23, 40), (0, 40), ((1,), (0,), (1,))),
        "weighted_table_0": L("rb", (0, 3, 10), (0, 8), ((0,), (0,))),
        "weighted_table_1": L("rb", (0, 8, 20), (0, 12), ((last,), (0,))),
    }
    if plan == "grid":
        return shared_tw | {
            "table_2": L("rb", (0, 15, 30), (0, 16, 32), ((0, last), (last, 0))),
            "table_3": cuts["table_3"],
            "weighted_table_0": L("rb", (0, 3, 10), (0, 8), ((0,), (last,))),
            "weighted_table_1": L("rb", (0, 5, 12, 20), (0, 4, 12), ((1, 0), (0, 1), (last, 0))),
        }
    if plan == "grid_cuts":
        return shared_tw | cuts
    if plan == "grid_shared":
        return cuts | {
            "table_0": L("rb", (0, 4, 10), (0, 16), ((0,), (1,))),
            "table_1": L("rb", (0, 9, 20), (0, 24), ((1,), (1,))),
            "table_4": L("rb", (0, 3, 6, 10), (0, 16), ((last,), (0,), (last,))),
            "table_5": L("rb", (0, 5, 20), (0, 24), ((0,), (last,))),
        }
    if plan == "hier":
        return shared_tw | {
            "table_2": L("rb", (0, 11, 30), (0, 32), ((0,), (1,)), hierarchical=True),
            "table_3": L("rb", (0, 13, 26, 40), (0, 40), ((0,), (1,), (last,)), hierarchical=True),
            "table_4": L("rb", (0, 4, 10), (0, 16), ((last,), (0,)), hierarchical=True),
            "weighted_table_0": L("rb", (0, 3, 10), (0, 8), ((last - 1,), (last,)), hierarchical=True),
            "weighted_table_1": L.table_wise(20, 12, last),
        }
    ub = {
        "table_2": L("ub", (0, 15, 30), (0, 32), ((0,), (1,))),
        "table_3": L("ub", (0, 40), (0, 20, 40), ((last, 0),)),
        "weighted_table_0": L("ub", (0, 10), (0, 8), ((1,),)),
        "weighted_table_1": L("ub", (0, 6, 20), (0, 12), ((1,), (0,))),
    }
    if plan == "ub":
        return shared_tw | ub
    if plan == "ub_shared":
        return ub | {
            "table_0": L("ub", (0, 4, 10), (0, 16), ((0,), (1,))),
            "table_1": L("ub", (0, 20), (0, 24), ((1,),)),
            "table_4": L("ub", (0, 10), (0, 8, 16), ((last, 0),)),
            "table_5": L("ub", (0, 5, 20), (0, 24), ((0,), (last,))),
        }
    raise ValueError(f"no embark layouts named {plan!r}")


def make_plan(case: Case, tables: HarnessTables, model: nn.Module, pg: Any) -> Any:
    """The case's ShardingPlan for a TestSparseNN built on meta, the same for both sharders. Every rank plans (the
    planners are deterministic; _agreed_plan checks that the ranks agree), so a planner's error is raised on every
    rank; EXAMPLE_PLANS go through EmbarkPlanner.collective_plan, which raises rank 0's error on every rank, with
    constraints for all of the harness's `tables` (as TorchRec's tests build them), whether the model has them or not.
    Under row-wise Adagrad those plan the model as TorchRec's examples set it: RowWiseAdagrad through
    apply_optimizer_in_backward."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.types import ShardingPlan

    from embark_torchrec import EmbarkEmbeddingBagCollectionSharder, EmbarkPlanner
    from embark_torchrec.plan.layout.tables import Plan
    from embark_torchrec.plan.model.spec import ModelSpec
    from embark_torchrec.plan.model.topology import PRESETS
    from embark_torchrec.planner.parameter_sharding import module_sharding_plan

    world_size, fused = case.world_size, _fused_params(case.optimizer)
    ebcs = {f"sparse.{k}": m for k, m in model.sparse.named_children() if k in ("ebc", "weighted_ebc")}
    names = [name for ebc in ebcs.values() for name in ebc.embedding_bags]
    if case.plan in BUILTIN_TYPES or case.plan in CONSTRAINED:  # our sharder lists every built-in type on CPU
        planner = EmbeddingShardingPlanner(topology=_topology(world_size), constraints=_constraints(case.plan, names))
        return planner.plan(model, [EmbarkEmbeddingBagCollectionSharder(fused_params=fused)])
    if case.plan == "torchrec_planner":
        planner = EmbeddingShardingPlanner(topology=_topology(world_size))
        return planner.plan(model, [EmbeddingBagCollectionSharder(fused_params=fused)])
    # dgx-h100 at free collectives and de-duplication: with its 47.6 us per collective and 0.23 ns per ID these tiny
    # tables stay whole and reduction-based; and with no dense compute, behind whose backward DDP would hide the
    # tiny tables' all-reduces and make them all data-parallel (the case is here to run our types)
    h100 = PRESETS["dgx-h100"].with_overrides(collective_us=0.0, unique_ns_per_id=0.0, dense_ms_per_ksample=0.0)
    if case.plan in ("embark_planner", "embark_planner_h100"):
        hardware = h100 if case.plan.endswith("h100") else None
        planner = EmbarkPlanner(topology=_topology(world_size), batch_size=BATCH_SIZE, hardware=hardware)
        return planner.plan(model, [EmbarkEmbeddingBagCollectionSharder(fused_params=fused)])
    if case.plan in EXAMPLE_PLANS:
        every_table = [t.name for t in tables.tables + tables.weighted_tables]
        constraints = _example_constraints(case.plan, every_table, world_size)
        planner = EmbarkPlanner(_topology(world_size), BATCH_SIZE, constraints, hardware=h100)
        sharders = [EmbarkEmbeddingBagCollectionSharder(fused_params=fused)]
        if case.optimizer == "rowwise_adagrad":
            from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
            from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

            model = copy.deepcopy(model)
            apply_optimizer_in_backward(RowWiseAdagrad, model.sparse.parameters(), {"lr": LEARNING_RATE})
            sharders = [EmbarkEmbeddingBagCollectionSharder()]
        return planner.collective_plan(model, sharders, pg)
    layouts = _embark_layouts(case.plan, world_size)
    out = ShardingPlan(plan={})
    for path, ebc in ebcs.items():
        spec = ModelSpec.from_module(ebc, batch_size=BATCH_SIZE * world_size)
        mine = {name: layouts[name] for name in ebc.embedding_bags}
        out.plan[path] = module_sharding_plan(Plan(world_size, WORLDS[world_size], mine), spec, "cpu")
    return out


def plan_types(plan: Any) -> dict[str, str]:
    return {name: ps.sharding_type for module in plan.plan.values() for name, ps in module.items()}


class _FixedPlanner:
    """Stands in for the harness's hard-coded EmbeddingShardingPlanner and hands back the case's plan."""

    plan: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def collective_plan(self, *args: Any, **kwargs: Any) -> Any:
        return copy.deepcopy(type(self).plan)


@contextmanager
def _harness_planning(plan: Any) -> Iterator[None]:
    ts = harness()
    saved = ts.EmbeddingShardingPlanner
    _FixedPlanner.plan, ts.EmbeddingShardingPlanner = plan, _FixedPlanner
    try:
        yield
    finally:
        ts.EmbeddingShardingPlanner, _FixedPlanner.plan = saved, None


# ---------------------------------------------------------------- sharders and optimizers


def _fused_params(optimizer: str) -> dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kind = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }[optimizer]
    return {"optimizer": kind, "learning_rate": LEARNING_RATE, "eps": EPS}


def qcomms_config() -> Any:
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    return QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16)


def make_sharder(case: Case) -> Any:
    """Ours or TorchRec's own EmbeddingBagCollectionSharder, with the case's fused optimizer and QCommsConfig."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry

    from embark_torchrec import EmbarkEmbeddingBagCollectionSharder

    registry = None
    if case.option == "qcomms":
        registry = get_qcomm_codecs_registry(qcomms_config(), device=torch.device("cpu"))
    cls = EmbarkEmbeddingBagCollectionSharder if case.sharder == "embark" else EmbeddingBagCollectionSharder
    return cls(fused_params=_fused_params(case.optimizer), qcomm_codecs_registry=registry)


class RowwiseAdagrad(torch.optim.Optimizer):
    """fbgemm's EXACT_ROWWISE_ADAGRAD for an unsharded table: one accumulator per row and per column block of the
    plan (each shard keeps its own per-row state, as fbgemm's kernel does): acc += mean over the block's columns of
    g^2, w -= lr * g / (sqrt(acc) + eps). Rows without gradient are left alone, as in the sparse kernel."""

    def __init__(self, params: Sequence[nn.Parameter], blocks: Sequence[Sequence[tuple[int, int]]]) -> None:
        super().__init__(list(params), {"lr": LEARNING_RATE, "eps": EPS})
        self._blocks = {id(p): list(b) for p, b in zip(params, blocks, strict=True)}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                for lo, hi in self._blocks[id(p)]:
                    g = p.grad[:, lo:hi]
                    acc = self.state[p].setdefault((lo, hi), torch.zeros(p.shape[0]))
                    acc += g.pow(2).mean(dim=1)
                    p[:, lo:hi] -= group["lr"] * g / (acc.sqrt() + group["eps"]).unsqueeze(1)


def _column_blocks(plan: Any, path: str, table: str, dim: int) -> list[tuple[int, int]]:
    spec = plan.plan[path][table].sharding_spec
    if spec is None:
        return [(0, dim)]
    return sorted({(s.shard_offsets[1], s.shard_offsets[1] + s.shard_sizes[1]) for s in spec.shards})


def reference_optimizers(
    global_model: nn.Module, dense_names: set[str], optimizer: str, plan: Any
) -> list[torch.optim.Optimizer]:
    """The unsharded model's optimizers: the harness's SGD for what the sharded model trains outside the fused
    kernels (dense layers, data-parallel tables), the fused optimizer's equivalent for every other table."""
    dense, fused = [], []
    for name, param in global_model.named_parameters():
        (dense if name in dense_names else fused).append((name, param))
    out: list[torch.optim.Optimizer] = [torch.optim.SGD([p for _, p in dense], lr=LEARNING_RATE)]
    if not fused:
        return out
    params = [p for _, p in fused]
    if optimizer == "sgd":
        out.append(torch.optim.SGD(params, lr=LEARNING_RATE))
    elif optimizer == "adagrad":
        out.append(torch.optim.Adagrad(params, lr=LEARNING_RATE, eps=EPS))
    else:
        blocks = []
        for name, p in fused:
            path, table = name.removesuffix(".weight").rsplit(".embedding_bags.", 1)
            blocks.append(_column_blocks(plan, path, table, p.shape[1]))
        out.append(RowwiseAdagrad(params, blocks))
    return out


# ---------------------------------------------------------------- the two checks


def run_harness(case: Case, tables: HarnessTables, plan: Any, pg: Any) -> None:
    """TorchRec's own check: sharding_single_rank_test_single_process with the case's plan, sharder and inputs."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    used, weighted = tables.for_case(case)
    with _harness_planning(plan):
        harness().sharding_single_rank_test_single_process(
            pg=pg,
            device=torch.device("cpu"),
            rank=dist.get_rank(pg),
            world_size=case.world_size,
            model_class=TestSparseNN,
            embedding_groups=tables.embedding_groups,
            tables=used,
            sharders=[make_sharder(case)],
            optim=EmbOptimType.EXACT_SGD,
            weighted_tables=weighted,
            local_size=WORLDS[case.world_size],
            qcomms_config=qcomms_config() if case.option == "qcomms" else None,
            variable_batch_per_feature=case.option == "vbe",
            variable_batch_size=case.option == "vbs",
        )


def _tolerances(case: Case, reference: torch.Tensor) -> dict[str, float]:
    """The harness's: torch's defaults, or under quantized comms rtol 0.003 and atol = largest value x rtol."""
    if case.option != "qcomms":
        return {}
    scale = float(reference.detach().abs().max()) if reference.numel() else 0.0
    return {"rtol": QCOMMS_RTOL, "atol": max(scale * QCOMMS_RTOL, 1e-5)}


def _close(what: str, actual: torch.Tensor, expected: torch.Tensor, tol: Mapping[str, float]) -> None:
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)  # type: ignore[arg-type]


def _gather(t: torch.Tensor, pg: Any) -> list[torch.Tensor]:
    """Every rank's tensor (shapes may differ by rank)."""
    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, t.detach(), group=pg)
    return out


def _unwrapped(name: str) -> str:
    return name.removeprefix("_dmp_wrapped_module.").removeprefix("module.")


def run_driver(case: Case, tables: HarnessTables, plan: Any, pg: Any) -> int:
    """Our longer check with the harness's pieces: STEPS fused-optimizer steps, sharded against unsharded; returns
    how many shards of fused optimizer state it compared on this rank."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
    from torchrec.distributed.types import ShardedTensor, ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    ts = harness()
    rank = dist.get_rank(pg)
    used, weighted = tables.for_case(case)
    global_model, inputs = ts.gen_model_and_input(
        model_class=TestSparseNN,
        tables=used,
        embedding_groups=tables.embedding_groups,
        world_size=case.world_size,
        generate=ModelInput.generate_variable_batch_input if case.option == "vbe" else ModelInput.generate,
        weighted_tables=weighted,
        num_float_features=NUM_FLOAT_FEATURES,
        batch_size=BATCH_SIZE,
        variable_batch_size=case.option == "vbs",
        num_inputs=STEPS,
    )
    model = DistributedModelParallel(
        TestSparseNN(
            tables=used,
            weighted_tables=weighted,
            embedding_groups=tables.embedding_groups,
            dense_device=torch.device("cpu"),
            sparse_device=torch.device("meta"),
            num_float_features=NUM_FLOAT_FEATURES,
        ),
        env=ShardingEnv.from_process_group(pg),
        plan=copy.deepcopy(plan),
        sharders=[make_sharder(case)],
        device=torch.device("cpu"),
    )
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    local_opt = CombinedOptimizer(
        [model.fused_optimizer, KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=LEARNING_RATE))]
    )
    ts.copy_state_dict(model.state_dict(), global_model.state_dict(), exclude_predfix=ITP_PREFIX)
    ts.alter_global_ebc_dtype(global_model)
    global_opts = reference_optimizers(global_model, {_unwrapped(n) for n in dense}, case.optimizer, plan)
    global_params = dict(global_model.named_parameters())

    tol: dict[str, float] = {}
    for step, (global_input, local_inputs) in enumerate(inputs):
        local_opt.zero_grad()
        model.train(True)
        loss, pred = model(local_inputs[rank])
        loss.backward()
        for opt in global_opts:
            opt.zero_grad()
        global_model.train(True)
        global_loss, global_pred = global_model(global_input)
        global_loss.backward()
        tol = _tolerances(case, global_pred)
        losses = torch.stack(_gather(loss, pg))
        _close(f"step {step} loss (mean over ranks)", losses.mean(), global_loss.detach(), _tolerances(case, losses))
        _close(f"step {step} training predictions", torch.cat(_gather(pred, pg)), global_pred.detach(), tol)
        for name, param in sorted(dense.items()):
            expected = global_params[_unwrapped(name)].grad
            if expected is not None or param.grad is not None:  # a parameter neither side used has no gradient
                _close(f"step {step} gradient of {_unwrapped(name)}", param.grad, expected, _tolerances(case, expected))
        local_opt.step()
        for opt in global_opts:
            opt.step()

    with torch.no_grad():
        model.train(False)
        global_model.train(False)
        global_input, local_inputs = inputs[0]
        local_pred = torch.cat(_gather(model(local_inputs[rank]), pg))
        _close("evaluation predictions after the steps", local_pred, global_model(global_input), tol)

    global_state = global_model.state_dict()
    for key, value in model.state_dict().items():
        if key.startswith(ITP_PREFIX):
            continue
        reference = global_state[key]
        tol = _tolerances(case, reference)
        if not isinstance(value, ShardedTensor):
            _close(f"weight {key}", value, reference, tol)
            continue
        for shard in value.local_shards():
            region = reference
            for dim, (offset, size) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)):
                region = region.narrow(dim, offset, size)
            _close(f"weight {key}, shard at {shard.metadata.shard_offsets}", shard.tensor, region, tol)
    if case.optimizer == "sgd":
        return 0
    return _check_optimizer_state(case, model, global_model, global_opts[-1], plan, pg)


def _check_optimizer_state(
    case: Case, model: nn.Module, global_model: nn.Module, reference: torch.optim.Optimizer, plan: Any, pg: Any
) -> int:
    """The fused optimizer's state, as its state_dict gives it (what a checkpoint saves), equals the reference's:
    EXACT_ADAGRAD's per-weight sums shard by shard; EXACT_ROWWISE_ADAGRAD's per-row sums, laid out as TorchRec does
    (one block of rows per column block of the plan: global index = block x rows + row), and its shards over all
    ranks tile each state's global size. Returns how many state shards this rank compared."""
    from torchrec.distributed.types import ShardedTensor

    params = dict(global_model.named_parameters())
    checked = 0
    layouts: dict[str, tuple[list[int], list[tuple[list[int], list[int]]]]] = {}
    for name, states in model.fused_optimizer.state_dict()["state"].items():
        param = params[name]
        path, table = name.removesuffix(".weight").rsplit(".embedding_bags.", 1)
        for key, value in states.items():
            if not isinstance(value, ShardedTensor):
                continue
            pieces = layouts.setdefault(key, (list(value.size()), []))[1]
            for shard in value.local_shards():
                offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                pieces.append((list(offsets), list(sizes)))
                if case.optimizer == "adagrad":
                    expected = reference.state[param]["sum"]
                    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
                        expected = expected.narrow(dim, offset, size)
                else:
                    rows = param.shape[0]
                    block, row = divmod(offsets[0], rows)
                    lo_hi = _column_blocks(plan, path, table, param.shape[1])[block]
                    expected = reference.state[param].get(lo_hi, torch.zeros(rows))[row : row + sizes[0]]
                _close(
                    f"optimizer state {key}, shard at {offsets}", shard.tensor, expected, _tolerances(case, expected)
                )
                checked += 1
    _check_tiling(layouts, pg)
    return checked


def _check_tiling(layouts: Mapping[str, tuple[list[int], list[tuple[list[int], list[int]]]]], pg: Any) -> None:
    """Every optimizer state's shards, over all ranks, cover its global size exactly once (what a checkpoint of the
    fused optimizer needs: no element twice, none missing)."""
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, dict(layouts), group=pg)
    merged: dict[str, tuple[list[int], list[tuple[list[int], list[int]]]]] = {}
    for rank_layouts in everyone:
        for key, (size, pieces) in rank_layouts.items():
            merged.setdefault(key, (size, []))[1].extend(pieces)
    for key, (size, pieces) in sorted(merged.items()):
        count = torch.zeros(size, dtype=torch.int32)
        for offsets, sizes in pieces:
            region = count
            for dim, (offset, length) in enumerate(zip(offsets, sizes)):
                region = region.narrow(dim, offset, length)
            region += 1
        if not bool((count == 1).all()):
            raise AssertionError(
                f"optimizer state {key}: its shards {sorted(pieces)} do not cover its global size {size} exactly once "
                f"({int((count == 0).sum())} elements uncovered, {int((count > 1).sum())} covered twice or more)"
            )


# ---------------------------------------------------------------- the rank entry point


def expected_checks(case: Case) -> set[str]:
    """The checks a case runs: the harness only with SGD (TorchRec's asserts EXACT_SGD)."""
    return {c for c in case.checks if c != "harness" or case.optimizer == "sgd"}


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"


def _meta_model(case: Case, tables: HarnessTables, cache: dict[Any, nn.Module]) -> nn.Module:
    """The case's TestSparseNN on meta, for planning (planners only read it, so cases with the same tables share
    one: building it costs more than planning)."""
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    used, weighted = tables.for_case(case)
    key = (id(used), id(weighted))
    if key not in cache:
        cache[key] = TestSparseNN(
            tables=used,
            weighted_tables=weighted,
            embedding_groups=tables.embedding_groups,
            sparse_device=torch.device("meta"),
            num_float_features=NUM_FLOAT_FEATURES,
        )
    return cache[key]


def _agreed_plan(case: Case, tables: HarnessTables, meta: nn.Module, pg: Any) -> tuple[Any, str | None]:
    """(the plan, None) when every rank planned the same; else (None, this rank's planning error, or the first
    rank's, or the mismatch)."""
    try:
        mine: tuple[Any, str | None] = (make_plan(case, tables, meta, pg), None)
    except Exception as exc:  # noqa: BLE001 - reported per case
        mine = (None, _failure(exc))
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, mine, group=pg)
    if mine[1] is not None:
        return None, f"(rank {dist.get_rank(pg)} planning) {mine[1]}"
    for rank, (_, error) in enumerate(everyone):
        if error is not None:
            return None, f"(rank {rank} planning) {error}"
    if any(plan.plan != everyone[0][0].plan for plan, _ in everyone):
        return None, f"PlanMismatch: the ranks planned differently: {[plan_types(p) for p, _ in everyone]}"
    return mine[0], None


def _run_case(case: Case, tables: HarnessTables, meta: nn.Module, pg: Any) -> Outcome:
    outcome = Outcome()
    plan, error = _agreed_plan(case, tables, meta, pg)
    if error is not None:
        outcome.checks["plan"] = error
        return outcome
    outcome.plan_types = plan_types(plan)
    if case.sharder == "torchrec" and any(t.startswith("embark_") for t in outcome.plan_types.values()):
        outcome.checks[NOT_RUNNABLE] = "TorchRec's own sharder cannot run our sharding types"
        return outcome
    for label, check in (("harness", run_harness), ("driver", run_driver)):
        if label not in expected_checks(case):
            continue
        try:
            compared = check(case, tables, plan, pg)
            outcome.checks[label] = None
            outcome.state_shards += compared or 0
        except Exception as exc:  # noqa: BLE001 - reported per case
            outcome.checks[label] = _failure(exc)
    return outcome


def run_cases(cases: Sequence[Case], progress_path: str | None = None) -> dict[str, Outcome]:
    """Every case, one after the other, on this rank (run_ranks runs it on all ranks): plan, then TorchRec's
    harness (SGD cases) and our driver, each case on a fresh process group whose collectives time out, so one
    failing case leaves the next ones a clean start. Rank 0 writes each case's name to progress_path as it starts
    (what the caller names when the whole run times out)."""
    tables = harness_tables()
    models: dict[Any, nn.Module] = {}
    results: dict[str, Outcome] = {}
    for case in cases:
        if case.world_size != dist.get_world_size():
            raise ValueError(f"{case.name} needs {case.world_size} ranks, this group has {dist.get_world_size()}")
        if progress_path is not None and dist.get_rank() == 0:
            with open(progress_path, "w") as f:
                f.write(case.name)
        start = time.monotonic()
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=CASE_TIMEOUT_S))
        torch.use_deterministic_algorithms(True)  # as the harness's MultiProcessContext
        try:
            outcome = _run_case(case, tables, _meta_model(case, tables, models), pg)
        finally:
            torch.use_deterministic_algorithms(False)
            dist.destroy_process_group(pg)
        outcome.seconds = time.monotonic() - start
        results[case.name] = outcome
    return results
