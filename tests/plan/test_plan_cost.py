"""Cost model: closed forms equal message-by-message counting, and hand-computed cases."""

from __future__ import annotations

import ast
import inspect
import math

import numpy as np
import pytest

from embark_torchrec.plan.cost.load import RankLoad
from embark_torchrec.plan.cost.model import BACKWARD_COMPUTE_MULTIPLIER, CostModel, OptimizerMemory
from embark_torchrec.plan.layout.tables import Plan, TableLayout, WirePrecision
from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import PRESETS, Topology
from embark_torchrec.plan.cost.traffic import Message, table_messages
from embark_torchrec.plan.layout import kinds
from embark_torchrec.plan.layout.kinds import PricingContext
from embark_torchrec.plan.layout.wire import vector_bytes


def _counted(cost: CostModel, msgs: list[Message], hierarchical: bool = False) -> dict[str, np.ndarray]:
    """Bytes per rank by direction and link; "paired": a hierarchical layout's stage 2 (its partial sums and
    their gradients crossing nodes, each from a rank to one of its local rank)."""
    w, topology = cost.topology.world_size, cost.topology
    rows = ("send_intra", "recv_intra", "send_inter", "recv_inter", "send_paired", "recv_paired")
    out = {k: np.zeros(w) for k in rows}
    for s, d, what, x in ((m.src, m.dst, m.kind, m.nbytes) for m in msgs):
        kind = "intra" if topology.node_of(s) == topology.node_of(d) else "inter"
        out[f"send_{kind}"][s] += x
        out[f"recv_{kind}"][d] += x
        if kind == "inter" and hierarchical and what in ("embeddings", "gradients"):
            assert s % topology.local_world_size == d % topology.local_world_size
            out["send_paired"][s] += x
            out["recv_paired"][d] += x
    return out


def _model(**table: object) -> ModelSpec:
    t = TableSpec(**{"name": "t", "rows": 1000, "dim": 16, "pooling": 3.0, **table})
    return ModelSpec(name="m", batch_size=96, tables=(t,))


LAYOUTS = {
    "table_wise": TableLayout("rb", (0, 1000), (0, 16), ((5,),)),
    "column_wise": TableLayout("rb", (0, 1000), (0, 8, 16), ((1, 6),)),
    "row_wise_flat": TableLayout("rb", (0, 250, 600, 1000), (0, 16), ((0,), (1,), (4,))),
    "row_wise_hier": TableLayout("rb", (0, 250, 600, 1000), (0, 16), ((0,), (1,), (4,)), hierarchical=True),
    "grid_hier": TableLayout("rb", (0, 300, 1000), (0, 4, 16), ((0, 2), (3, 7)), hierarchical=True),
    "grid_same_rank": TableLayout("rb", (0, 300, 1000), (0, 4, 16), ((2, 2), (2, 5))),
    "ub_grid": TableLayout("ub", (0, 300, 1000), (0, 8, 16), ((0, 4), (4, 7))),
    "ub_same_rank": TableLayout("ub", (0, 300, 1000), (0, 8, 16), ((3, 3), (3, 6))),
    "grid_hier_same_rank": TableLayout(
        "rb", (0, 200, 700, 1000), (0, 8, 16), ((1, 1), (1, 2), (5, 1)), hierarchical=True
    ),
    "table_wise_hier": TableLayout("rb", (0, 1000), (0, 16), ((3,),), hierarchical=True),
    "fp16_fp8": TableLayout("rb", (0, 500, 1000), (0, 16), ((0,), (6,)), WirePrecision("fp16", "fp8"), True),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("lws", [2, 4, 8])
def test_closed_forms_equal_message_counting(name: str, lws: int) -> None:
    """The bytes each rank sends and receives, intra and inter node, and between ranks of one local rank in a
    hierarchical stage 2, equal message-by-message counts."""
    spec = _model(feature_names=("f1", "f2"), id_distribution=None)
    cost = CostModel(spec, Topology(8, lws))
    load = cost.table_load("t", LAYOUTS[name])
    expected = _counted(cost, table_messages(cost, "t", LAYOUTS[name]), LAYOUTS[name].hierarchical)
    for key, arr in expected.items():
        np.testing.assert_allclose(getattr(load, key), arr, rtol=1e-12, atol=1e-9, err_msg=key)


def test_table_wise_hand_computed() -> None:
    """One table-wise table, 4 ranks as 2 nodes x 2: every figure by hand."""
    spec = ModelSpec("m", 8, (TableSpec("t", rows=100, dim=8, pooling=2.0),))
    cost = CostModel(spec, Topology(4, 2, PRESETS["cpu-gloo"]), OptimizerMemory(bytes_per_element=4, bytes_per_row=0))
    load = cost.table_load("t", TableLayout("rb", (0, 100), (0, 8), ((0,),)))
    b = 2  # samples per rank
    ids_in = 2 * b * 8 + b * 4  # pooling 2 -> 4 int64 IDs and 2 int32 lengths from each rank
    out = b * 8 * 4  # one fp32 pooled row of 8 per sample, forward; the same back in backward
    assert load.recv_intra[0] == ids_in + out  # from rank 1: IDs, then gradients
    assert load.recv_inter[0] == 2 * (ids_in + out)  # from ranks 2 and 3
    assert load.send_intra[0] == out and load.send_inter[0] == 2 * out
    assert load.send_inter[2] == ids_in + out and load.recv_inter[2] == out
    assert load.lookup_bytes[0] == 8 * 2 * 8 * 4 * (1 + BACKWARD_COMPUTE_MULTIPLIER)
    assert load.memory[0] == 100 * 8 * 8 and load.memory[1:].sum() == 0


def test_dp_allreduce_and_step_parts() -> None:
    """DP: no forward bytes, a ring all-reduce of the gradient (2 (W-1)/W of it per rank, 1/L of that
    through the rank's NIC when there are several nodes; the slower link sets the time), memory on
    every rank."""
    spec = ModelSpec("m", 64, (TableSpec("t", rows=10, dim=8, pooling=1.0),))
    hw = PRESETS["dgx-h100"]
    cost = CostModel(spec, Topology(16, 8, hw))
    load = cost.table_load("t", TableLayout.data_parallel())
    grad = 10 * 8 * 4
    ring = 2 * 15 / 16 * grad
    assert load.dp_inter == pytest.approx(ring / 8)
    assert load.dp_intra == pytest.approx(ring * 7 / 8)
    assert load.send_intra.sum() == 0 and load.send_inter.sum() == 0
    step = cost.step_cost(load)
    assert step.dp_allreduce_ms == pytest.approx(
        max(load.dp_intra / (hw.intra_node_bw_gbps * 1e6), load.dp_inter / (hw.inter_node_bw_gbps * 1e6))
    )
    one_node = CostModel(spec, Topology(8, 8, hw)).table_load("t", TableLayout.data_parallel())
    assert (one_node.dp_intra, one_node.dp_inter) == (pytest.approx(2 * 7 / 8 * grad), 0.0)
    assert step.dense_ms == pytest.approx(4 / 1000 * hw.dense_ms_per_ksample)
    # two: the DP group's own DDP all-reduce and its module's split exchange
    assert step.collective_ms == pytest.approx(2 * hw.collective_us / 1e3)
    # DDP all-reduces during the backward: the overlap is the all-reduce, up to the backward's share of the compute
    backward = (step.lookup_ms + 4 / 1000 * hw.dense_ms_per_ksample) * 2 / 3
    assert step.overlap_ms == pytest.approx(min(step.dp_allreduce_ms, backward)) and step.overlap_ms > 0
    assert step.step_ms == pytest.approx(
        step.lookup_ms + step.comm_ms + step.collective_ms + step.dp_allreduce_ms + step.dense_ms - step.overlap_ms
    )


def test_precision_scales_bytes() -> None:
    """fp16 halves embedding bytes; fp8 carries one byte per element plus a 4-byte scale per row."""
    assert vector_bytes(128, "fp16") == vector_bytes(128, "fp32") / 2
    assert vector_bytes(128, "bf16") == 256
    assert vector_bytes(128, "fp8") == 128 + 4


def test_ub_bytes_scale_with_unique_ratio() -> None:
    """UB embedding bytes are proportional to the unique ratio; RB bytes do not depend on it."""
    layout_ub = TableLayout("ub", (0, 1000), (0, 16), ((1,),))
    layout_rb = TableLayout("rb", (0, 1000), (0, 16), ((1,),))
    loads = {}
    for ratio in (0.1, 0.2):
        cost = CostModel(_model(unique_ratio=ratio), Topology(4, 2))
        loads[ratio] = (cost.table_load("t", layout_ub), cost.table_load("t", layout_rb))
    assert loads[0.2][0].send_inter[1] == pytest.approx(2 * loads[0.1][0].send_inter[1])
    assert loads[0.2][1].send_inter[1] == loads[0.1][1].send_inter[1]


def test_hierarchy_moves_bytes_from_network_to_nvlink() -> None:
    """A row-split table on one node: hierarchical reduction sends fewer bytes across nodes."""
    cost = CostModel(_model(), Topology(8, 4))
    flat = TableLayout("rb", (0, 500, 1000), (0, 16), ((0,), (1,)))
    hier = TableLayout("rb", (0, 500, 1000), (0, 16), ((0,), (1,)), hierarchical=True)
    a, h = cost.table_load("t", flat), cost.table_load("t", hier)
    assert h.send_inter.sum() < a.send_inter.sum()
    assert h.send_intra.sum() > a.send_intra.sum()
    assert math.isclose(h.lookup_bytes.sum(), a.lookup_bytes.sum())


def test_plan_cost_is_sum_of_tables() -> None:
    """A plan's per-rank load is the sum of its tables' loads."""
    spec = ModelSpec("m", 96, (TableSpec("a", 1000, 16, 3.0), TableSpec("b", 50, 8, 1.0)))
    cost = CostModel(spec, Topology(8, 4))
    plan = Plan(8, 4, {"a": LAYOUTS["grid_hier"], "b": TableLayout("rb", (0, 50), (0, 8), ((3,),))})
    total = cost.rank_load(plan)
    parts = [cost.table_load("a", plan["a"]), cost.table_load("b", plan["b"])]
    np.testing.assert_allclose(total.send_inter, parts[0].send_inter + parts[1].send_inter)
    np.testing.assert_allclose(total.memory, parts[0].memory + parts[1].memory)


@pytest.mark.parametrize("cluster", ["rb", "ub"])
def test_single_cell_shortcut_equals_full_computation(cluster: str) -> None:
    """The renumbered load of a one-cell table on rank k equals computing it from scratch, on every rank."""
    spec = _model(feature_names=("f1", "f2"))
    cost = CostModel(spec, Topology(12, 4))
    for k in range(12):
        layout = TableLayout(cluster, (0, 1000), (0, 16), ((k,),), WirePrecision("fp16", "fp32"))
        fast, slow = cost.table_load("t", layout), cost._table_load("t", layout)
        np.testing.assert_allclose(fast.rows, slow.rows, rtol=1e-12, err_msg=f"rank {k}")


def test_ub_pays_de_duplication_where_it_is_slow() -> None:
    """A UB table costs every rank b F p x unique_ns_per_id of de-duplication (its IDs, sorted on the CPU); RB
    tables and the GPU presets (zero) pay none; it is part of each rank's lookup time."""
    spec = _model(feature_names=("f1", "f2"))
    hw = PRESETS["cpu-gloo"]
    cost = CostModel(spec, Topology(4, 2, hw))
    ub = cost.table_load("t", TableLayout("ub", (0, 1000), (0, 16), ((1,),)))
    rb = cost.table_load("t", TableLayout("rb", (0, 1000), (0, 16), ((1,),)))
    per_rank = cost.local_batch * 2 * 3.0 * hw.unique_ns_per_id / 1e6
    np.testing.assert_allclose(ub.host_ms, per_rank)
    assert rb.host_ms.sum() == 0.0 and hw.unique_ns_per_id > 0
    np.testing.assert_allclose(
        cost.step_cost(ub).rank_lookup_ms,
        ub.lookup_bytes / (hw.hbm_bw_gbps * 1e6) + ub.lookup_ids * hw.lookup_ns_per_id / 1e6 + per_rank,
    )


def test_every_id_a_cell_looks_up_costs_lookup_ns_per_id() -> None:
    """Each cell of a row slice looks up all of that slice's IDs, whatever its width: a column split doubles the
    IDs looked up (and their per-ID cost) while the lookup bytes stay the same; a row split keeps both."""
    spec = _model(feature_names=("f1", "f2"))
    hw = PRESETS["cpu-gloo"]
    cost = CostModel(spec, Topology(4, 2, hw))
    t = spec.table("t")
    tw = cost.table_load("t", TableLayout("rb", (0, 1000), (0, 16), ((1,),)))
    cw = cost.table_load("t", TableLayout("rb", (0, 1000), (0, 8, 16), ((1, 2),)))
    rw = cost.table_load("t", TableLayout("rb", (0, 300, 1000), (0, 16), ((1,), (2,))))
    ids = spec.batch_size * 2 * t.pooling
    assert tw.lookup_ids.tolist() == [0.0, ids, 0.0, 0.0]
    assert cw.lookup_ids.tolist() == [0.0, ids, ids, 0.0]
    np.testing.assert_allclose(rw.lookup_ids, [0.0, 0.3 * ids, 0.7 * ids, 0.0])
    assert cw.lookup_bytes.sum() == pytest.approx(tw.lookup_bytes.sum()) == pytest.approx(rw.lookup_bytes.sum())
    extra = cost.step_cost(cw).rank_lookup_ms - cw.lookup_bytes / (hw.hbm_bw_gbps * 1e6)
    np.testing.assert_allclose(extra, cw.lookup_ids * hw.lookup_ns_per_id / 1e6)
    assert hw.lookup_ns_per_id > 0 and PRESETS["dgx-h100"].lookup_ns_per_id == 0.0


def test_ranks_sharing_a_hosts_cores_look_up_no_faster_than_the_cores_allow() -> None:
    """With host_cores, the step's lookups take max(slowest rank, all ranks' lookups / cores): on a CPU box that
    hosts every rank, spreading a table over more ranks does not help once the cores are busy."""
    spec = _model()
    layout = TableLayout("rb", (0, 250, 500, 750, 1000), (0, 16), ((0,), (1,), (2,), (3,)))
    for cores in (0, 1, 2, 4):
        hw = PRESETS["cpu-gloo"].with_overrides(host_cores=cores)
        step = CostModel(spec, Topology(4, 2, hw)).evaluate(Plan(4, 2, {"t": layout}))
        per_rank = step.rank_lookup_ms
        assert step.lookup_ms == pytest.approx(max(per_rank.max(), per_rank.sum() / cores) if cores else per_rank.max())
        assert (step.lookup_ms > per_rank.max()) == (0 < cores < 4)


def test_dense_all_reduce_is_priced_at_the_plans_allreduce_precision() -> None:
    """The dense gradients' ring all-reduce crosses nodes at DDP's precision (Plan.allreduce_precision): fp16
    halves its bytes, so its time on a network-bound cluster, and nothing else of the step."""
    spec = ModelSpec("m", 64, (TableSpec("t", rows=10, dim=8, pooling=1.0),))
    hw = PRESETS["dgx-h100"].with_overrides(dense_params_mb=100.0, inter_node_bw_gbps=1.0, collective_us=0.0)
    cost = CostModel(spec, Topology(16, 8, hw))
    layouts = {"t": TableLayout.table_wise(10, 8, 0)}
    fp32, fp16 = (cost.evaluate(Plan(16, 8, layouts, {}, p)) for p in ("fp32", "fp16"))
    compute = 4 / 1000 * hw.dense_ms_per_ksample
    inter = 2 * 15 / 16 * 100e6 / 8  # a rank's ring bytes through its NIC
    assert fp32.dense_ms - compute == pytest.approx(inter / 1e6)
    assert fp16.dense_ms - compute == pytest.approx(inter / 2 / 1e6)
    assert (fp16.lookup_ms, fp16.comm_ms, fp16.collective_ms) == (fp32.lookup_ms, fp32.comm_ms, fp32.collective_ms)


def test_each_distinct_row_a_cell_touches_costs_update_ns_per_row() -> None:
    """A TBE's backward and optimizer work per distinct row: a small table's cells touch (about) all its rows
    however many IDs the batch holds, a large table's about one row per ID; row slices share them by their rows,
    and the cost lands on each cell's holder."""
    spec = ModelSpec("m", 4096, (TableSpec("small", 300, 16, 30.0), TableSpec("large", 10_000_000, 16, 1.0)))
    hw = PRESETS["cpu-gloo"].with_overrides(update_ns_per_row=400.0)
    cost = CostModel(spec, Topology(4, 2, hw))
    small = cost.rows_touched("small", (0, 100, 300))
    assert small == pytest.approx([100, 200], rel=1e-3)  # 122,880 draws over 300 rows hit every row
    large = cost.rows_touched("large", (0, 10_000_000))
    assert large[0] == pytest.approx(4096, rel=1e-3)  # 4,096 draws over 10M rows: nearly all distinct
    split = TableLayout("rb", (0, 100, 300), (0, 16), ((1,), (2,)))
    without = CostModel(spec, Topology(4, 2, PRESETS["cpu-gloo"])).table_load("small", split)
    extra = cost.table_load("small", split).host_ms - without.host_ms
    assert extra == pytest.approx([0, 100 * 400e-6, 200 * 400e-6, 0], rel=1e-3)


@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_paired_inter_node_bytes_run_at_the_paired_rate(ratio: float) -> None:
    """A hierarchical table's stage 2 (every rank to its local rank's peers on other nodes) is priced at
    inter_node_paired_ratio x the inter-node rate, the rest of the inter-node bytes at that rate; at ratio 1
    (files without the figure) nothing changes."""
    spec = _model(feature_names=("f1", "f2"), id_distribution=None)
    hw = PRESETS["dgx-h100"]
    paired = CostModel(spec, Topology(8, 2, hw.with_overrides(inter_node_paired_ratio=ratio)))
    flat = CostModel(spec, Topology(8, 2, hw))
    bw = hw.inter_node_bw_gbps * 1e6
    for name in ("row_wise_hier", "grid_hier", "row_wise_flat", "ub_grid"):
        load = paired.table_load("t", LAYOUTS[name])
        _, _, inter = paired.rank_times(load.rows)
        _, _, unpaired = flat.rank_times(load.rows)
        stage2 = np.maximum(load.send_paired, load.recv_paired)
        np.testing.assert_allclose(inter, unpaired + stage2 * (1 / ratio - 1) / bw, rtol=1e-12)
        assert (stage2 > 0).any() == LAYOUTS[name].hierarchical, name
        assert (load.send_paired <= load.send_inter).all() and (load.recv_paired <= load.recv_inter).all()


def test_a_node_s_ranks_share_its_link_where_the_hardware_says_so() -> None:
    """Hardware.inter_node_solo_ratio > 1 (one link per node, as on the emulated cluster): a node's ranks drain
    their sends (and apart their receives) at the all-ranks rate while all are busy, and a rank left alone at up to
    the solo ratio x that rate; so one busy rank beside an idle one is cheaper than alone on its link, an even load
    costs what it always did, and at ratio 1 (the presets: a link per rank) nothing changes."""
    spec = ModelSpec("m", 64, (TableSpec("t", rows=1000, dim=16, pooling=4.0),))
    hw = PRESETS["cpu-gloo"]
    shared = CostModel(spec, Topology(4, 2, hw.with_overrides(inter_node_solo_ratio=1.73)))
    alone = CostModel(spec, Topology(4, 2, hw))
    rows = RankLoad.zeros(4).rows  # every byte in the forward phase
    rows[3] = [33.0, 65.0, 10.0, 10.0]  # send_inter: node 0 uneven, node 1 even
    rows[4] = [20.0, 20.0, 50.0, 0.0]  # recv_inter
    per_byte = 1 / (hw.inter_node_bw_gbps * 1e6)
    # rank 1 alone after 33; rank 2 receives alone from the start (its node-mate receives nothing)
    expected = np.array([33.0, 33 + 32 / 1.73, 50 / 1.73, 10.0])
    np.testing.assert_allclose(shared.shared_link_inter_ms(rows), expected * per_byte, rtol=1e-12)
    whole_link = CostModel(spec, Topology(4, 2, hw.with_overrides(inter_node_solo_ratio=8.0)))
    assert whole_link.shared_link_inter_ms(rows)[1] == pytest.approx((33 + 65) / 2 * per_byte)  # at most L x
    layout = TableLayout("rb", (0, 1000), (0, 16), ((1,),))
    uneven = alone.table_load("t", layout)
    assert shared.step_cost(uneven).comm_ms < alone.step_cost(uneven).comm_ms
    even = alone.table_load("t", TableLayout("rb", (0, 250, 500, 750, 1000), (0, 16), ((0,), (1,), (2,), (3,))))
    assert shared.step_cost(even).comm_ms == pytest.approx(alone.step_cost(even).comm_ms, rel=1e-12)


def test_a_rank_s_one_way_bytes_run_at_the_one_way_rate() -> None:
    """Hardware.inter_node_one_way_ratio > 1 (gloo's half-duplex pairs): a rank's inter-node sends and receives cost
    the smaller of the two at the both-ways rate and the rest at ratio x it, with or without a shared link; even
    traffic costs what it always did, and at ratio 1 (the presets) a rank's time is max(sent, received) as before."""
    spec = ModelSpec("m", 64, (TableSpec("t", rows=1000, dim=16, pooling=4.0),))
    hw = PRESETS["cpu-gloo"]
    per_byte = 1 / (hw.inter_node_bw_gbps * 1e6)
    rows = RankLoad.zeros(4).rows  # every byte in the forward phase
    rows[3] = [60.0, 10.0, 30.0, 30.0]  # send_inter
    rows[4] = [20.0, 10.0, 30.0, 0.0]  # recv_inter
    one_way = CostModel(spec, Topology(4, 2, hw.with_overrides(inter_node_one_way_ratio=1.5)))
    _, _, inter = one_way.rank_times(rows)
    np.testing.assert_allclose(inter, np.array([20 + 40 / 1.5, 10.0, 30.0, 30 / 1.5]) * per_byte, rtol=1e-12)
    _, _, plain = CostModel(spec, Topology(4, 2, hw)).rank_times(rows)
    np.testing.assert_allclose(plain, np.array([60.0, 10.0, 30.0, 30.0]) * per_byte, rtol=1e-12)
    # on a shared link the sends and the receives drain apart (water filling), then combine the same way
    both = CostModel(spec, Topology(4, 2, hw.with_overrides(inter_node_solo_ratio=2.0, inter_node_one_way_ratio=1.5)))
    solo = CostModel(spec, Topology(4, 2, hw.with_overrides(inter_node_solo_ratio=2.0)))
    rows[3], rows[4] = [30.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0]
    np.testing.assert_allclose(both.shared_link_inter_ms(rows), solo.shared_link_inter_ms(rows) / [1.5, 1, 1, 1])


def test_a_rank_s_phases_are_priced_one_after_another_where_they_do_not_overlap() -> None:
    """The input dist's IDs, the forward's partial sums and the backward's gradients cross the network in turn where
    Hardware.inter_node_phase_overlap is 0 (the emulated cluster): a table-wise table's holder receives the other
    node's IDs, sends it partial sums, then receives their gradients, and its network time is the three's sum, not
    the larger of what it sent and received in the whole step (which the presets, at 1, keep to the bit). Per phase
    the one-way ratio applies: each of the holder's phases runs one way."""
    spec = ModelSpec("m", 512, (TableSpec("t", rows=1000, dim=16, pooling=4.0),))
    hw = PRESETS["cpu-gloo"]
    per_byte = 1 / (hw.inter_node_bw_gbps * 1e6)
    in_turn = CostModel(spec, Topology(2, 1, hw.with_overrides(inter_node_phase_overlap=0.0)))
    load = in_turn.table_load("t", TableLayout("rb", (0, 1000), (0, 16), ((0,),)))
    ids, grads = load.recv_inter_ids[0], load.recv_inter_grads[0]
    sums = load.send_inter[0]
    assert ids > 0 and grads > 0 and sums > 0 and load.recv_inter[0] == pytest.approx(ids + grads)
    assert (load.send_inter_ids[0], load.send_inter_grads[0]) == (0.0, 0.0)  # the holder sends only partial sums
    assert in_turn.rank_times(load.rows)[2][0] == pytest.approx((ids + sums + grads) * per_byte, rel=1e-12)
    whole = max(sums, ids + grads) * per_byte
    assert (ids + sums + grads) * per_byte > 1.5 * whole
    assert CostModel(spec, Topology(2, 1, hw)).rank_times(load.rows)[2][0] == whole
    half = CostModel(spec, Topology(2, 1, hw.with_overrides(inter_node_phase_overlap=0.5)))
    assert half.rank_times(load.rows)[2][0] == pytest.approx((whole + (ids + sums + grads) * per_byte) / 2)
    one_way = in_turn.topology.hardware.with_overrides(inter_node_one_way_ratio=1.6)
    priced = CostModel(spec, Topology(2, 1, one_way)).rank_times(load.rows)[2][0]
    assert priced == pytest.approx((ids + sums + grads) / 1.6 * per_byte, rel=1e-12)


def test_the_phases_a_report_shows_add_up_to_the_priced_inter_node_time() -> None:
    """CostModel.phase_network_ms (what benchmarks/step_stages.py sets beside the measured waits): where phases do
    not overlap, each rank's IDs', forward's and gradients' network time plus its paired premium is exactly the
    inter-node time the step is priced with, on a shared link (water filling per phase) and on a link per rank."""
    spec = ModelSpec("m", 512, (TableSpec("t", rows=1000, dim=16, pooling=4.0), TableSpec("u", 500, 8, 2.0)))
    hw = PRESETS["cpu-gloo"].with_overrides(inter_node_phase_overlap=0.0, inter_node_paired_ratio=0.8)
    plan = {
        "t": TableLayout("rb", (0, 500, 1000), (0, 16), ((1,), (1,)), hierarchical=True),
        "u": TableLayout("rb", (0, 500), (0, 8), ((2,),)),
    }
    for solo in (1.0, 1.8):
        cost = CostModel(spec, Topology(4, 2, hw.with_overrides(inter_node_solo_ratio=solo)))
        rows = cost.rank_load(plan).rows
        phases = cost.phase_network_ms(rows)
        assert len(phases) == 3 and all((p > 0).any() for p in phases)
        premium = np.maximum(rows[8], rows[9]) * cost.paired_premium_ms_per_byte
        assert (premium > 0).any()
        priced = cost.shared_link_inter_ms(rows) if solo > 1 else cost.rank_times(rows)[2]
        np.testing.assert_allclose(sum(phases) + premium, priced, rtol=1e-12)


def test_all_reduces_run_at_the_measured_bus_bandwidth_where_there_is_one() -> None:
    """Hardware.allreduce_bus_gbps > 0: a DP table's and the dense part's all-reduces cost the ring's bytes per rank
    (2 (W-1)/W of the gradient) over the measured bus bandwidth, whatever the links; 0: the ring's slowest link."""
    spec = ModelSpec("m", 64, (TableSpec("t", rows=1000, dim=8, pooling=1.0),))
    hw = PRESETS["cpu-gloo"].with_overrides(dense_params_mb=2.0)
    measured = CostModel(spec, Topology(4, 2, hw.with_overrides(allreduce_bus_gbps=0.005)))
    ring = CostModel(spec, Topology(4, 2, hw))
    load = measured.table_load("t", TableLayout.data_parallel())
    step, ring_step = measured.step_cost(load), ring.step_cost(load)
    assert step.dp_allreduce_ms == pytest.approx(2 * 3 / 4 * 1000 * 8 * 4 / 0.005e6)
    assert step.dense_ms - measured.dense_compute_ms == pytest.approx(
        2 * 3 / 4 * 2e6 / 0.005e6
        + ring_step.dense_ms
        - ring.dense_compute_ms
        - ring.ring_allreduce_ms(*ring.ring_allreduce_bytes(2e6))
    )
    assert ring_step.dp_allreduce_ms == pytest.approx(ring.ring_allreduce_ms(load.dp_intra, load.dp_inter))


def test_the_kinds_price_against_exactly_the_cost_model_members_their_protocol_declares() -> None:
    """ClusterKind prices with a PricingContext, not a CostModel (which stands above it): every member the kinds
    call on it is declared there, and the cost model has every member declared (no type checker runs, so a rename in
    CostModel or a new call in a kind fails here rather than when a test happens to price that kind)."""
    tree = ast.parse(inspect.getsource(kinds))
    called = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "cost"}
    declared = {n for n in vars(PricingContext) if not n.startswith("_")} | set(PricingContext.__annotations__)
    assert called == declared
    assert isinstance(CostModel(_model(), Topology(4, 2, PRESETS["dgx-h100"])), PricingContext)
