"""Device placement: every tensor our sharding's dists, codecs and counters create lives on the device they were given.

Property: for every sharding type the sharder emits (TorchRec's table_wise through our sharder; our "embark_rb" flat
grid, "embark_rb_hier" hierarchical grid and "embark_ub" unique-based cluster, each at fp32, fp16 and fp8 on the wire),
on every rank of a 4-rank world in 2 nodes, an EmbarkShardedEmbeddingBagCollection sharded onto device D holds no
tensor on any other device: not in the input dists (built lazily on the first batch; built here the way that batch
would), not in the output dists, not in the sharding objects, codecs or the communication counters
(enable_comm_stats), nor in any tensor-valued attribute of any object reachable from them (lists, tuples, dicts,
dataclasses, hooks; walked recursively). TorchRec keeps its dists in plain Python lists, so `.to()` and
`named_buffers()` never move or see them: a tensor created on the CPU stays there, and on CUDA the first step mixes
devices (or copies host to device on every step).

How, without a GPU: D is the meta device, a sentinel. Everything is built on a fake process group (fake_world; no
collective runs and no TBE forward runs, they cannot on meta), so any tensor that ignores the device shows up on the
CPU. A construction that reads a device tensor's values on the host (`.tolist()`, `torch.unique` of a buffer, ...) fails
on meta; it is reported as a failure too: on CUDA it is a device-to-host sync per dist built, and what it computes
belongs in Python lists built from the plan.

Out of scope (not ours): fbgemm's TBE kernels and their fused optimizer (fbgemm keeps a few CPU scalars by design), and
torch's DeviceMesh (its rank map is a CPU tensor by design).

Also (test_input_dist_cut_under_fake_cuda): the pure-tensor part of each of our input dists' forward (the ID cutting /
de-duplication before the first collective) runs under FakeTensorMode on a fake "cuda" device with a fake cuda batch
(SUM and MEAN tables); every op must get its tensors on one device (checked per op: fbgemm's fake kernels do not check
it themselves), and the first collective must be given device tensors. It stops, and passes, at that collective (or
TorchRec's KJT all-to-all), or earlier where fake tensors cannot go on: a Python conversion of a tensor (int(), bool()),
a branch on a data-dependent value, or an op a CPU-only torch cannot fake on cuda.
"""

from __future__ import annotations

import re

import dataclasses
import traceback
import types
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torchrec.distributed.comm as torchrec_comm
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.groups import sharding_group
from embark_torchrec.plan.layout.tables import Plan, TableLayout, WirePrecision
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.sharding.comm_stats import enable_comm_stats
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.testing import fake_world
from embark_torchrec.testing.host_work import COLLECTIVES

pytestmark = pytest.mark.timeout(120)

WS, LWS, ROWS, DIM = 4, 2, 40, 8
META = torch.device("meta")
# t1 is MEAN-pooled, so the dists' per-feature mean flags (and their buffers) are exercised too
TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f0"]),
    EmbeddingBagConfig(
        name="t1", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f1"], pooling=PoolingType.MEAN
    ),
]
FEATURES = ["f0", "f1"]
# per sharding type: the layout of each table (as in test_plan_groups), all in that one sharding type
LAYOUTS: dict[str, tuple[TableLayout, TableLayout]] = {
    "table_wise": (TableLayout.table_wise(ROWS, DIM, 1), TableLayout.table_wise(ROWS, DIM, 2)),
    "embark_rb": (TableLayout("rb", (0, 15, 40), (0, 4, 8), ((0, 1), (3, 2))),) * 2,  # a 2x2 grid
    "embark_rb_hier": (TableLayout("rb", (0, 15, 40), (0, 4, 8), ((0, 1), (2, 3)), hierarchical=True),) * 2,
    # a table-wise UB table and a row-split UB table
    "embark_ub": (TableLayout.table_wise(ROWS, DIM, 0, "ub"), TableLayout("ub", (0, 25, 40), (0, DIM), ((1,), (3,)))),
}
OURS = [kind for kind in LAYOUTS if kind.startswith("embark_")]
CASES = [("table_wise", "fp32")] + [(kind, p) for kind in OURS for p in ("fp32", "fp16", "fp8")]


def _layouts(kind: str, precision: str) -> dict[str, TableLayout]:
    wire = WirePrecision(precision, precision)
    return {t.name: dataclasses.replace(layout, precision=wire) for t, layout in zip(TABLES, LAYOUTS[kind])}


def _expected_type(kind: str, precision: str) -> str:
    return kind if precision == "fp32" else f"{kind}:{precision}-{precision}"


# ------------------------------------------------------------------------------------------------- the walk

_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, torch.device, torch.dtype, range)


def _foreign(obj: Any) -> bool:
    """Objects out of scope: process groups, torch's DeviceMesh, and fbgemm's TBE modules (see module docstring)."""
    if isinstance(obj, dist.ProcessGroup) or type(obj).__name__ == "DeviceMesh":
        return True
    return isinstance(obj, nn.Module) and type(obj).__module__.startswith("fbgemm_gpu")


def stray_tensors(roots: dict[str, Any], device: torch.device) -> tuple[list[str], int]:
    """Every tensor reachable from `roots` (named objects) that is not on `device`, as 'path: device dtype shape';
    and how many tensors were seen. Walks modules (buffers, parameters, submodules, hooks, plain attributes),
    containers, dataclasses and any object's __dict__ / __slots__, each object once."""
    seen: set[int] = set()
    stray: list[str] = []
    count = 0

    def visit(obj: Any, path: str, depth: int) -> None:
        nonlocal count
        if isinstance(obj, torch.Tensor):
            count += 1
            if obj.device != device:
                stray.append(f"{path}: {obj.device} {str(obj.dtype).replace('torch.', '')} {list(obj.shape)}")
            return
        if isinstance(obj, _LEAVES) or id(obj) in seen or depth > 40 or _foreign(obj):
            return
        seen.add(id(obj))
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.BuiltinMethodType)):
            for i, cell in enumerate(getattr(obj, "__closure__", None) or ()):
                try:
                    visit(cell.cell_contents, f"{path}.<closure {i}>", depth + 1)
                except ValueError:  # an empty cell
                    pass
            return
        if isinstance(obj, types.MethodType):
            visit(obj.__self__, f"{path}.__self__", depth + 1)
            return
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                visit(value, f"{path}[{key!r}]", depth + 1)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for i, value in enumerate(list(obj)):
                visit(value, f"{path}[{i}]", depth + 1)
            return
        attrs: dict[str, Any] = {}
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    attrs[slot] = getattr(obj, slot)
        attrs.update(getattr(obj, "__dict__", {}))
        for key, value in attrs.items():
            label = path if key in ("_buffers", "_parameters", "_modules") else f"{path}.{key}"
            visit(value, label, depth + 1)

    for name, root in roots.items():
        visit(root, name, 0)
    return stray, count


def test_the_walk_finds_stray_tensors() -> None:
    """The sentinel works: a CPU tensor hidden in a buffer, a list attribute, a nested object's dict, a hook and a
    closure is found; meta tensors are not reported."""

    class Codec:
        def __init__(self) -> None:
            self.scale = {"rows": [torch.ones(2)]}

    class Dist(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("ok", torch.empty(3, device=META))
            self.register_buffer("bad", torch.zeros(3))
            self.table = [(torch.zeros(1, device=META), torch.zeros(1))]
            self.codec = Codec()
            hidden = torch.zeros(4)
            self.register_forward_hook(lambda *_: hidden)

    stray, count = stray_tensors({"dists": [Dist()]}, META)
    assert count == 6
    # a hook's key is a process-wide handle id, so it depends on what ran before in this process
    found = sorted(re.sub(r"_forward_hooks\[\d+\]", "_forward_hooks[id]", s.split(":")[0]) for s in stray)
    assert found == sorted(
        [
            "dists[0]['bad']",
            "dists[0].table[0][1]",
            "dists[0].codec.scale['rows'][0]",
            "dists[0]._forward_hooks[id].<closure 0>",
        ]
    )


# ------------------------------------------------------------------------------------------------- building


@pytest.fixture
def fresh_node_groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torchrec caches the intra/cross-node groups in module globals; each fake world must make its own."""
    monkeypatch.setattr(torchrec_comm, "_INTRA_PG", None)
    monkeypatch.setattr(torchrec_comm, "_CROSS_PG", None)
    yield


def _meta_inputs(
    layouts: dict[str, TableLayout], tables: list[EmbeddingBagConfig] = TABLES
) -> tuple[EmbeddingBagCollection, dict[str, Any]]:
    """The EBC on meta and its parameter shardings, placed on the meta device (a TBE checks that its weights'
    device matches the shard placement)."""
    module = EmbeddingBagCollection(tables=tables, device=META)
    spec = ModelSpec.from_module(module, batch_size=WS)
    return module, dict(module_sharding_plan(Plan(WS, LWS, layouts), spec, "meta"))


def _describe(error: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "embark_torchrec" in f.filename]
    where = (
        f" at {frames[-1].filename.split('embark_torchrec/')[-1]}:{frames[-1].lineno} ({frames[-1].line})"
        if frames
        else ""
    )
    message = str(error).splitlines()[0][:120] if str(error) else ""
    return f"{type(error).__name__}: {message}{where}"


def _dists_one_by_one(module: EmbeddingBagCollection, params: dict[str, Any], env: ShardingEnv) -> list[str]:
    """When the whole module cannot be built: each sharding's input and output dist built alone, exactly as the
    sharded EBC builds them (input: create_input_dist() without a device, as torchrec calls it; output: with the
    module's device), so that every stray tensor and every construction error is reported, not only the first."""
    cls = EmbarkEmbeddingBagCollectionSharder().sharded_module_type
    problems: list[str] = []
    infos = cls.create_grouped_sharding_infos(module, params, "embedding_bags.", None)
    for kind, sharding_infos in infos.items():
        try:
            sharding = cls.create_embedding_bag_sharding(sharding_infos, env, META, permute_embeddings=True)
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"{kind} sharding: construction raised {_describe(e)}")
            continue
        problems += stray_tensors({f"{kind} sharding": sharding}, META)[0]
        builders = (
            ("input dist", lambda: sharding.create_input_dist()),
            ("output dist", lambda: sharding.create_output_dist(device=META)),
        )
        for which, build in builders:
            try:
                built = build()
            except Exception as e:  # noqa: BLE001 - reported
                problems.append(f"{kind} {which}: construction raised {_describe(e)}")
                continue
            problems += stray_tensors({f"{kind} {which}": built}, META)[0]
    return problems


def _placement_problems(kind: str, precision: str, rank: int) -> tuple[list[str], int]:
    layouts = _layouts(kind, precision)
    assert {sharding_group(layouts[t.name], ROWS, WS, LWS).name for t in TABLES} == {_expected_type(kind, precision)}
    with fake_world(WS, rank=rank, local_world_size=LWS) as pg:
        module, params = _meta_inputs(layouts)
        env = ShardingEnv.from_process_group(pg)
        sharder = EmbarkEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
        try:
            sharded = sharder.shard(module, params, env, device=META)
            sharded._create_input_dist(FEATURES)  # what the first batch does (torchrec builds input dists lazily)
            enable_comm_stats(sharded)  # the counters, and torchrec's lazily built pooled all-to-alls
        except Exception as e:  # noqa: BLE001 - reported, with the details of each dist
            return [f"sharding the module on meta raised {_describe(e)}"] + _dists_one_by_one(module, params, env), 0
        # the dists first (for the shortest paths), then all else the module holds (its own buffers, the input
        # validator, the comm stats, ...), but the lookups and their fused optimizer
        first = ("_input_dists", "_output_dists", "_embedding_shardings")
        roots = {name: getattr(sharded, name) for name in first}
        roots.update({name: v for name, v in vars(sharded).items() if name not in first + ("_lookups", "_optim")})
        return stray_tensors(roots, META)


@pytest.mark.parametrize("rank", range(WS))
@pytest.mark.parametrize("kind,precision", CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_dists_codecs_and_counters_live_on_their_device(
    fresh_node_groups: None, kind: str, precision: str, rank: int
) -> None:
    problems, seen = _placement_problems(kind, precision, rank)
    assert not problems, (
        f"{_expected_type(kind, precision)} on rank {rank} of {WS} ({LWS} per node), sharded onto {META}: "
        f"{len(problems)} tensors / errors off the device:\n  " + "\n  ".join(problems)
    )
    assert seen > 0  # the walk reached the module's tensors


# ------------------------------------------------------------------------------------------------- fake cuda (optional)


class _EndOfPureTensorPart(Exception):
    """Raised in place of the first collective (or host read of a tensor's value): the part before it is over."""

    def __init__(self, what: str, tensors: list[torch.Tensor]) -> None:
        super().__init__(what)
        self.what, self.tensors = what, tensors


_HOST_READS = ("__int__", "__float__", "__bool__", "__index__")  # .item() / .tolist() give symbols instead


def _stop_at_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first collective, TorchRec KJT all-to-all or Python conversion of a tensor ends the pure-tensor part."""
    from torchrec.distributed.dist_data import KJTAllToAll

    def collective(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            leaves = pytree.tree_leaves((args, kwargs))
            raise _EndOfPureTensorPart(name, [t for t in leaves if isinstance(t, torch.Tensor)])

        return call

    def kjt_all_to_all(self: Any, kjt: KeyedJaggedTensor) -> Any:
        tensors = [kjt.values(), kjt.lengths()] + ([kjt.weights()] if kjt.weights_or_none() is not None else [])
        raise _EndOfPureTensorPart("KJTAllToAll", tensors)

    def host_read(name: str) -> Callable[..., Any]:
        def call(self: torch.Tensor, *args: Any) -> Any:
            raise _EndOfPureTensorPart(f"Tensor.{name} (a host read)", [])

        return call

    for name in (*COLLECTIVES, "barrier"):
        monkeypatch.setattr(dist, name, collective(f"torch.distributed.{name}"))
    monkeypatch.setattr(KJTAllToAll, "forward", kjt_all_to_all)
    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, host_read(name))


class _OneDevice(TorchDispatchMode):
    """Every op's tensor arguments on one device (CPU 0-dim scalars aside), as CUDA kernels require: fake
    tensors check this for aten ops, but fbgemm's fake kernels do not."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        devices = {
            str(t.device)
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")
        }
        if len(devices) > 1:
            raise AssertionError(f"{func} was given tensors on {sorted(devices)}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("kind", OURS)
def test_input_dist_cut_under_fake_cuda(
    fresh_node_groups: None, monkeypatch: pytest.MonkeyPatch, kind: str, pooling: str
) -> None:
    """Our input dist, built for a fake cuda device, cuts a fake cuda batch (ID cutting / de-duplication) up to its
    first collective, with every op's tensors on that device. (With MEAN tables today's grid stops at once, at
    int(lengths.sum()); the SUM case carries the grid's check.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    cuda = torch.device("cuda")
    layouts = _layouts(kind, "fp32")
    tables = TABLES if pooling == "mean" else [dataclasses.replace(t, pooling=PoolingType.SUM) for t in TABLES]
    with fake_world(WS, rank=0, local_world_size=LWS) as pg:
        module, params = _meta_inputs(layouts, tables)
        cls = EmbarkEmbeddingBagCollectionSharder().sharded_module_type
        (sharding_infos,) = cls.create_grouped_sharding_infos(module, params, "embedding_bags.", None).values()
        env = ShardingEnv.from_process_group(pg)  # outside fake mode: its DeviceMesh reads a CPU tensor
        # with a ShapeEnv, data-dependent sizes and .item() / .tolist() become symbols, so the cut runs past them
        with FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True, allow_dynamic_output_shape_ops=True)):
            sharding = cls.create_embedding_bag_sharding(sharding_infos, env, cuda, permute_embeddings=True)
            input_dist = sharding.create_input_dist()  # as torchrec calls it: no device
            kjt = KeyedJaggedTensor(  # 4 bags per feature, IDs on both sides of every row cut
                keys=FEATURES,
                values=torch.tensor([3, 17, 30, 39] * len(FEATURES), dtype=torch.int64, device=cuda),
                lengths=torch.tensor([1, 2, 0, 1] * len(FEATURES), dtype=torch.int32, device=cuda),
                stride=4,
                length_per_key=[4]
                * len(FEATURES),  # on the host already, as the sharded EBC's input validation leaves it
            )
            try:
                with monkeypatch.context() as patch, _OneDevice():
                    _stop_at_collectives(patch)
                    result = input_dist(kjt)
                    while hasattr(result, "wait"):  # an awaitable that has not communicated yet
                        result = result.wait()
            except _EndOfPureTensorPart as end:
                off = [f"{list(t.shape)} on {t.device}" for t in end.tensors if t.device.type != "cuda"]
                assert not off, f"{end.what} was given tensors off the device: {off}"
                return
            except GuardOnDataDependentSymNode:
                return  # Python branches on a value only real data has: the tensor ops so far were on the device
            except RuntimeError as e:
                # a CPU-only torch cannot go on (e.g. indexing by an index of data-dependent size on fake cuda needs a
                # cuda device guard); every op before it was checked, and one mixing devices fails in _OneDevice first
                if "not linked with support for cuda" not in str(e):
                    raise
                return
            pytest.fail(f"the input dist returned {type(result).__name__} without any collective")
