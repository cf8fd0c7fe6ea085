"""Host work of a training step: no blocking collectives, and host work that does not grow with the tables.

On a GPU the host must run ahead of the device: a collective without async_op=True or a device->host sync stalls
it, and host work per table makes a step of many tables host-bound. HostWorkCounter counts those on CPU. One
4-rank spawn (2 nodes x 2, so the hierarchical grid has two nodes) trains every sharding type we emit, at every
wire precision, and TorchRec's table-wise, at 4 and at 16 tables, and counts the second training step (the first
builds the lazily created dists). TorchRec's table-wise and row-wise tables at fp16 from the plan, and its
table-wise ones at fp8 where the plan chose TorchRec's sharding (TorchRec's shardings, the plan's codecs as their
registry), are counted beside the same tables at fp32 with the sharder's codec registry at that precision,
TorchRec's own way. The unit tests check the counter itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.groups import ShardingGroup, module_collectives_per_step, sharding_group
from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision
from embark_torchrec.plan.layout.wire import ROW_SCALED_PRECISIONS
from embark_torchrec.plan.model.fields import POOLED
from embark_torchrec.sharding.codecs import wire_codecs
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.host_work import COLLECTIVES, HostWorkCounter
from embark_torchrec.testing.training import sharded_model
from tests.support import toy
from tests.support.host_work import second_step_work, show

WS, LWS, BATCH = 4, 2, 4
ROWS, DIM = 40, 8
TABLE_COUNTS = (4, 16)
OURS = ("embark_rb", "embark_rb_hier", "embark_ub")
PRECISIONS = ("fp32", "fp16", "fp8")
OUR_CASES = [f"{kind}:{p}" for kind in OURS for p in PRECISIONS]
BASELINE = "table_wise:fp32"
OPS_GROWTH, OPS_SLACK = 1.5, 10  # aten ops at 16 tables <= ops at 4 tables * growth + slack
SYNC_MARGIN = 4  # our syncs <= TorchRec table-wise's + margin
# our aten ops <= TorchRec table-wise's x ratio: 2.0 until the input check's cheap path (rows alike, issue 41) took the
# same 9 ops off both, which left UB at fp8 94 ops and the flat grid 92 against table-wise's 44 at 4 tables
OPS_RATIO = 2.2
# TorchRec's types below fp32 from the plan, each against the same type at fp32 with the sharder's codec registry:
# case -> (the plan's precision, that registry). fp16: QCommsConfig(fp16)'s. Table-wise at fp8 (where the plan chose
# TorchRec's sharding): our row-scaled codec told the width (QCommsConfig(FP8, fp8_quantize_dim)'s fbgemm codec has no
# CPU kernel). Row-wise at TorchRec's FP8: QCommsConfig(FP8)'s own registry, which sends a reduce-scatter's FP8 at fp16
# forward and bf16 backward (get_qcomm_codecs_registry), so the plan's row-wise table at fp16 / bf16 is its equal (a
# plan's row-wise at fp8 sends fp8 partial sums, which only our dists can: embark_rb:fp8 above)
FP16, FP8 = WirePrecision("fp16", "fp16"), WirePrecision("fp8", "fp8")


def _qcomms(precision: CommType) -> Callable[[], Any]:
    """The sharder's registry of QCommsConfig at `precision` both ways, built when called."""
    return lambda: get_qcomm_codecs_registry(QCommsConfig(precision, precision))


TORCHREC_BELOW_FP32 = {
    "table_wise:fp16": (FP16, _qcomms(CommType.FP16)),
    "row_wise:fp16": (FP16, _qcomms(CommType.FP16)),
    "table_wise:fp8": (FP8, lambda: wire_codecs(FP8, row_width=DIM)),
    "row_wise:fp8": (WirePrecision("fp16", "bf16"), _qcomms(CommType.FP8)),
}
QCOMMS = ":qcomms"


def _layout(kind: str, i: int, precision: WirePrecision) -> TableLayout:
    """Table i's layout; placements rotate with i, so every rank holds cells of several tables."""
    if kind == "table_wise":
        layout = TableLayout.table_wise(ROWS, DIM, i % WS)
    elif kind == "row_wise":  # TorchRec's ceil blocks over every rank
        step = -(-ROWS // WS)
        layout = TableLayout("rb", tuple(range(0, ROWS, step)) + (ROWS,), (0, DIM), tuple((k,) for k in range(WS)))
    elif kind == "embark_rb":  # a 2x2 grid over four ranks
        layout = TableLayout(
            "rb", (0, 15, ROWS), (0, 4, DIM), tuple(tuple((i + 2 * r + c) % WS for c in range(2)) for r in range(2))
        )
    elif kind == "embark_rb_hier":  # column c on node (i + c) mod 2, its two row slices on that node's two ranks
        ranks = tuple(tuple(((i + c) % 2) * LWS + r for c in range(2)) for r in range(2))
        layout = TableLayout("rb", (0, 15, ROWS), (0, 4, DIM), ranks, hierarchical=True)
    else:
        layout = TableLayout("ub", (0, 25, ROWS), (0, DIM), ((i % WS,), ((i + 1) % WS,)))
    # a table-wise table at fp8 runs on TorchRec's sharding where its plan says so (torchrec_at_fp8)
    fp8_on_torchrec = kind == "table_wise" and precision.forward == "fp8"
    return dataclasses.replace(layout, precision=precision, torchrec_at_fp8=fp8_on_torchrec)


def _step(model: torch.nn.Module, kjt: KeyedJaggedTensor) -> None:
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    out.values().sum().backward()


def _count_steps() -> dict[str, dict[str, Any]]:
    """On each rank: {"<type>:<precision>:<tables>": HostWorkCounter summary of the second training step}."""
    result = {}
    for n in TABLE_COUNTS:
        tables = toy.equal_tables(EmbeddingBagConfig, n, ROWS, DIM)
        for case in [BASELINE, *OUR_CASES, *TORCHREC_BELOW_FP32, *(c + QCOMMS for c in TORCHREC_BELOW_FP32)]:
            kind, precision, *qcomms = case.split(":")
            plan_precision, registry_of = TORCHREC_BELOW_FP32.get(f"{kind}:{precision}", (None, None))
            if qcomms:
                plan_precision = WirePrecision()
            elif plan_precision is None:
                plan_precision = WirePrecision(precision, precision)
            layouts = {t.name: _layout(kind, i, plan_precision) for i, t in enumerate(tables)}
            runs_as = {sharding_group(layout, ROWS, WS, LWS) for layout in layouts.values()}
            p = layouts["t0"].precision
            width = DIM if {p.forward, p.backward} & ROW_SCALED_PRECISIONS else 0
            builtin = ShardingGroup(POOLED, kind, precision=p, row_width=width)
            assert runs_as == {ShardingGroup.ours(layouts["t0"]) if kind in OURS else builtin}, (case, runs_as)
            registry = registry_of() if qcomms else None
            model = sharded_model(tables, layouts, LWS, qcomm_codecs_registry=registry)
            result[f"{case}:{n}"] = second_step_work(model, tables, WS, BATCH, _step)
    return result


@pytest.fixture(scope="module")
def counts() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_count_steps, WS, local_world_size=LWS, timeout_s=600)


# ---------------------------------------------------------------- the counter itself


def test_counts_host_syncs_by_op() -> None:
    """Reading a value or a data-dependent size on the host is a sync, tolist included; other ops are not."""
    x = torch.arange(6.0)
    with HostWorkCounter() as counter:
        y = x * 2 + 1
        y.sum().item()
        x.tolist()
        x[x > 2]
        torch.nonzero(x)
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # the size is known: no sync
        x[torch.tensor([0, 2])]  # integer indices: no sync
    assert counter.sync_ops == {
        "aten._local_scalar_dense.default": 1,
        "Tensor.tolist": 1,
        "aten.index.Tensor": 1,
        "aten.nonzero.default": 1,
        "aten.repeat_interleave.Tensor": 1,
    }
    assert counter.host_syncs == 5
    assert counter.aten_ops == sum(counter.ops.values()) >= 10
    assert counter.collectives == counter.blocking_collectives == 0


def test_patches_are_restored_after_nesting_and_exceptions() -> None:
    """Nested counters both count; on exit, an exception included, tolist and the collectives are the originals."""
    originals = {(m.__name__, name): getattr(m, name) for m in (dist, c10d) for name in COLLECTIVES}
    with pytest.raises(RuntimeError, match="boom"):
        with HostWorkCounter() as outer:
            with HostWorkCounter() as inner:
                torch.ones(2).tolist()
            torch.ones(2).tolist()
            raise RuntimeError("boom")
    assert (outer.sync_ops["Tensor.tolist"], inner.sync_ops["Tensor.tolist"]) == (2, 1)
    assert "tolist" not in torch.Tensor.__dict__
    assert {(m.__name__, name): getattr(m, name) for m in (dist, c10d) for name in COLLECTIVES} == originals
    with HostWorkCounter() as after:
        torch.ones(2).sum()
    assert after.ops == {"aten.ones.default": 1, "aten.sum.default": 1}


def _collectives_on_one_rank() -> dict[str, Any]:
    t = torch.ones(2)
    with HostWorkCounter() as counter:
        dist.all_reduce(t)  # blocking
        dist.all_reduce(t, dist.ReduceOp.SUM, None, True).wait()  # async, async_op passed by position
        dist.all_to_all_single(torch.empty(2), t, async_op=True).wait()
        c10d.broadcast(t, 0)  # through distributed_c10d, blocking
    return counter.summary()


def test_counts_blocking_collectives() -> None:
    """Collectives count on torch.distributed and distributed_c10d; only those without async_op=True block."""
    (summary,) = run_ranks(_collectives_on_one_rank, 1, timeout_s=120)
    assert summary["collectives"] == 4
    assert summary["blocking_ops"] == {"all_reduce": 1, "broadcast": 1}


def test_counter_sees_torchrec_collectives(counts: list[dict[str, dict[str, Any]]]) -> None:
    """TorchRec's table-wise step issues its 5 collectives (its group's 4 and the module's split exchange) through
    torch.distributed, all async, on every rank."""
    for n in TABLE_COUNTS:
        for c in counts:
            table_wise = ShardingGroup.parse("table_wise")
            assert c[f"{BASELINE}:{n}"]["collectives"] == module_collectives_per_step([table_wise]) == 5
            assert c[f"{BASELINE}:{n}"]["blocking_collectives"] == 0


# ---------------------------------------------------------------- our sharding types


@pytest.mark.parametrize("case", OUR_CASES)
def test_no_blocking_collectives(counts: list[dict[str, dict[str, Any]]], case: str) -> None:
    """Every collective of a training step is issued with async_op=True, on every rank."""
    for n in TABLE_COUNTS:
        blocking = {rank: c[f"{case}:{n}"]["blocking_ops"] for rank, c in enumerate(counts)}
        assert all(not b for b in blocking.values()), f"{case}, {n} tables: blocking collectives per rank {blocking}"


@pytest.mark.parametrize("case", OUR_CASES)
def test_host_work_does_not_grow_with_tables(counts: list[dict[str, dict[str, Any]]], case: str) -> None:
    """Host work is O(sharding groups), not O(tables): from 4 to 16 tables, aten ops grow at most 1.5x (+ slack)
    and host syncs not at all (rank 0)."""
    few, many = (counts[0][f"{case}:{n}"] for n in TABLE_COUNTS)
    detail = f"{case}: 4 tables {show(few)}; 16 tables {show(many)}"
    assert many["aten_ops"] <= few["aten_ops"] * OPS_GROWTH + OPS_SLACK, detail
    assert many["host_syncs"] == few["host_syncs"], detail


@pytest.mark.parametrize("case", OUR_CASES)
def test_syncs_at_most_torchrec_table_wise(counts: list[dict[str, dict[str, Any]]], case: str) -> None:
    """A step of ours syncs at most 4 times more than TorchRec's table-wise step on the same tables (rank 0)."""
    for n in TABLE_COUNTS:
        ours, base = counts[0][f"{case}:{n}"], counts[0][f"{BASELINE}:{n}"]
        assert ours["host_syncs"] <= base["host_syncs"] + SYNC_MARGIN, (
            f"{case}, {n} tables: ours {show(ours)}; torchrec table_wise {show(base)}"
        )


@pytest.mark.parametrize("case", OUR_CASES)
def test_aten_ops_at_most_twice_torchrec_table_wise(counts: list[dict[str, dict[str, Any]]], case: str) -> None:
    """A step of ours dispatches at most twice the aten ops of TorchRec's table-wise step, at every wire
    precision (rank 0)."""
    for n in TABLE_COUNTS:
        ours, base = counts[0][f"{case}:{n}"], counts[0][f"{BASELINE}:{n}"]
        assert ours["aten_ops"] <= base["aten_ops"] * OPS_RATIO, (
            f"{case}, {n} tables: ours {show(ours)}; torchrec table_wise {show(base)}"
        )


@pytest.mark.parametrize("case", TORCHREC_BELOW_FP32)
def test_torchrec_types_at_the_plans_precision_work_as_with_qcomms(
    counts: list[dict[str, dict[str, Any]]], case: str
) -> None:
    """TorchRec's table-wise and row-wise sharding at fp16, its table-wise at fp8 (where the plan chose it) and its
    row-wise at TorchRec's FP8 (fp16 / bf16 in the plan) from the plan dispatch the same aten ops, host syncs and
    collectives (none blocking) as the same tables at fp32 with the sharder's codec registry at that precision (every
    rank): the plan's precision is TorchRec's own compression, not a detour through our dists."""
    for n in TABLE_COUNTS:
        for rank, c in enumerate(counts):
            ours, theirs = c[f"{case}:{n}"], c[f"{case}{QCOMMS}:{n}"]
            for field in ("aten_ops", "host_syncs", "collectives"):
                assert ours[field] == theirs[field], f"{case}, {n} tables, rank {rank}: {show(ours)}; {show(theirs)}"
            assert ours["blocking_collectives"] == 0
