"""Sequence tables (an EmbeddingCollection's: one vector per ID) in the planner.

Pure: the table kind in model specs and plan files (round trips, old files load as pooled, unknown kinds refused by
name); the cost model's sequence bytes against a hand computation and against the traffic model's messages; the
planner's choices (only modules whose sharder is given, no replicated sequence tables on CPU, refusal of embark types
without our EC sharder); a plan file of an EBC and an EC loaded back by load_plan (wrong kinds and missing tables
refused by file, module and table); `--compare torchrec` planning sequence tables as TorchRec's EmbeddingCollection.
One spawn per world size (2 ranks; 4 as 2 nodes x 2): EmbarkPlanner plans a model holding a nested
EmbeddingBagCollection and an EmbeddingCollection (a table name in both) in one search, and DMP with both Embark
sharders trains it exactly as the unsharded model; and the bytes the EC's counters count for grid, row-split,
hierarchical (run flat), unique-based and reduced-precision layouts equal the traffic model's messages for the batch's
actual IDs, per rank, peer and kind, exactly.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan import cli
from embark_torchrec.plan.layout.constraints import TableConstraints
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.groups import ShardingGroup
from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.model.fields import SEQUENCE
from embark_torchrec.planner.planner import EmbarkPlanner
from embark_torchrec.plan.model.profile import profile_features
from embark_torchrec.plan.model.spec import ModelSpec, SpecError, TableSpec
from embark_torchrec.plan.model.topology import Topology, hardware_preset
from embark_torchrec.plan.cost.traffic import table_messages
from embark_torchrec.plan.layout.wire import LENGTH_BYTES, vector_bytes
from embark_torchrec.planner import cli as planner_cli
from embark_torchrec.planner import torchrec_plans
from embark_torchrec.sharding.comm_stats import enable_comm_stats
from embark_torchrec.planner.load_plan import load_plan
from embark_torchrec.sharding.sharded_ec import EmbarkEmbeddingCollectionSharder
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.sharding.torchrec_counting import ALL_TABLES
from embark_torchrec.testing import copy_global_weights, global_kjt_batch, ids_per_row_slice, run_ranks
from embark_torchrec.testing.sequence import sharded_sequence_model
from embark_torchrec.testing.training import OPTIMIZERS, weight_diffs

DIM, BATCH, LR, ATOL = 8, 4, 0.1, 1e-5
KINDS = ("ids", "lengths", "embeddings", "gradients")
WORLDS = {2: 2, 4: 2}  # world size -> local world size
CPU = hardware_preset("cpu-gloo")
SEQUENCE_AND_BAG = {  # a spec file with a sequence table and a pooled one, for the CLI
    "name": "seq",
    "batch_size": 1024,
    "tables": [
        {"name": "hist", "rows": 100000, "dim": 32, "pooling": 50, "kind": "sequence", "unique_ratio": 0.3},
        {"name": "bag", "rows": 1000, "dim": 32, "pooling": 1},
    ],
}

# ---------------------------------------------------------------- spec and plan files


def test_table_kind_round_trips_and_unknown_kinds_are_refused_by_name() -> None:
    seq = TableSpec(name="hist", rows=100, dim=8, pooling=20.0, kind="sequence")
    assert seq.is_sequence and seq.to_dict()["kind"] == "sequence"
    assert "kind" not in TableSpec(name="bag", rows=10, dim=8, pooling=1.0).to_dict()  # pooled: the default
    spec = ModelSpec(name="m", batch_size=8, tables=(seq, TableSpec(name="bag", rows=10, dim=8, pooling=1.0)))
    again = ModelSpec.from_dict(spec.to_dict())
    assert again == spec and [t.kind for t in again.tables] == ["sequence", "pooled"]
    with pytest.raises(SpecError, match="table 'hist': field 'kind': unknown table kind 'bag'"):
        TableSpec(name="hist", rows=100, dim=8, pooling=1.0, kind="bag")
    bad = spec.to_dict()
    bad["tables"][0]["kind"] = 3
    with pytest.raises(SpecError, match="table 'hist': field 'kind': unknown table kind 3"):
        ModelSpec.from_dict(bad)


def test_plan_file_carries_the_kind_and_old_files_load_as_pooled(tmp_path: Any) -> None:
    spec = ModelSpec(
        name="m",
        batch_size=8,
        tables=(
            TableSpec(name="hist", rows=100, dim=8, pooling=20.0, kind="sequence"),
            TableSpec(name="bag", rows=10, dim=8, pooling=1.0),
        ),
    )
    plan = Plan(
        2, 2, {"hist": TableLayout("ub", (0, 50, 100), (0, 8), ((0,), (1,))), "bag": TableLayout.data_parallel()}
    )
    written = plan.with_kinds(spec)
    d = written.to_dict()
    assert d["tables"]["hist"]["kind"] == "sequence" and "kind" not in d["tables"]["bag"]
    written.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded == written and loaded.kinds == {"hist": "sequence"}
    loaded.validate(spec)
    old = plan.to_dict()  # as files written before kinds: no "kind" anywhere
    assert Plan.from_dict(old).kinds == {}
    pooled = ModelSpec(name="m", batch_size=8, tables=(TableSpec(name="hist", rows=100, dim=8, pooling=1.0),))
    with pytest.raises(PlanError, match="table 'hist': the plan is for a sequence table, the model's is pooled"):
        Plan(2, 2, {"hist": written["hist"]}, written.kinds).validate(pooled)
    d["tables"]["hist"]["kind"] = "bags"
    with pytest.raises(PlanError, match="table 'hist': field 'kind': unknown table kind 'bags'"):
        Plan.from_dict(d)


def test_from_module_reads_an_embedding_collection_as_sequence_tables() -> None:
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="h", num_embeddings=30, embedding_dim=DIM, feature_names=["h0", "h1"])],
        device=torch.device("meta"),
    )
    (t,) = ModelSpec.from_module(ec).tables
    assert (t.name, t.rows, t.dim, t.feature_names, t.kind) == ("h", 30, DIM, ("h0", "h1"), "sequence")


def test_profile_features_measures_sequence_features() -> None:
    """An EmbeddingCollection's features are profiled like bags: pooling = mean sequence length, unique ratio =
    distinct / total IDs per batch (one minus the repeat rate); the spec's tables are sequence tables."""
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="h", num_embeddings=30, embedding_dim=DIM, feature_names=["h0"])],
        device=torch.device("meta"),
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["h0"], values=torch.tensor([1, 1, 2, 3, 1, 2]), lengths=torch.tensor([4, 2], dtype=torch.int32)
    )
    t = profile_features([kjt], ec).spec.table("h")
    assert (t.kind, t.pooling, t.unique_ratio) == ("sequence", 3.0, 0.5)


def test_cli_writes_the_kind_into_the_plan_file_and_reports_sequence_tables(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "seq.json"
    path.write_text(json.dumps(SEQUENCE_AND_BAG))
    out = tmp_path / "plan.json"
    assert (
        cli.main(
            [str(path), "--world-size", "4", "--local-world-size", "2", "--hardware", "cpu-gloo", "--out", str(out)]
        )
        == 0
    )
    assert "1 sequence tables (one vector per ID)" in capsys.readouterr().out
    plan = Plan.load(out)
    assert plan.kinds == {"hist": "sequence"}
    plan.validate(ModelSpec.from_dict(SEQUENCE_AND_BAG))


# ---------------------------------------------------------------- cost model


def _one_table(kind: str, pooling: float = 6.0, unique_ratio: float | None = 0.5) -> CostModel:
    t = TableSpec(
        name="t", rows=1000, dim=16, pooling=pooling, feature_names=("f0", "f1"), unique_ratio=unique_ratio, kind=kind
    )
    spec = ModelSpec(name="m", batch_size=4 * 32, tables=(t,))
    return CostModel(spec, Topology(4, 2, CPU))


def test_cost_model_prices_a_sequence_table_per_id_by_hand() -> None:
    """A row split of 1/4 and 3/4 of the rows, column slices of 4 and 12, at fp16 forward / bf16 backward: each cell
    sends every other rank F b p m_r vectors of its width, nothing reduced; hierarchical changes nothing; UB sends
    the same as for a pooled table; a data-parallel sequence table sends nothing."""
    seq, pooled = _one_table("sequence"), _one_table("pooled")
    f, b, p = 2, 32, 6.0
    prec = WirePrecision("fp16", "bf16")
    layout = TableLayout("rb", (0, 250, 1000), (0, 4, 16), ((0, 1), (2, 3)), prec)
    load = seq.table_load("t", layout)
    mass = np.array([0.25, 0.25, 0.75, 0.75])  # of the cell on rank k (one cell per rank)
    inputs = f * (b * p * mass * 4 + b * LENGTH_BYTES)  # its IDs (int32) and lengths, from each other rank
    outputs = f * b * p * mass * [vector_bytes(w, "fp16") for w in (4, 12, 4, 12)]  # to each other rank
    grads = f * b * p * mass * [vector_bytes(w, "bf16") for w in (4, 12, 4, 12)]  # from each other rank
    np.testing.assert_allclose(
        load.send_intra + load.send_inter, 3 * outputs + inputs.sum() - inputs + grads.sum() - grads
    )
    np.testing.assert_allclose(load.recv_intra + load.recv_inter, 3 * inputs + outputs.sum() - outputs + 3 * grads)
    flat = seq.table_load("t", TableLayout("rb", (0, 250, 1000), (0, 16), ((0,), (2,)), hierarchical=False))
    hier = seq.table_load("t", TableLayout("rb", (0, 250, 1000), (0, 16), ((0,), (2,)), hierarchical=True))
    np.testing.assert_array_equal(flat.rows, hier.rows)
    assert list(flat.groups) == list(hier.groups) == [ShardingGroup.parse("embark_rb", SEQUENCE)]
    ub = TableLayout("ub", (0, 250, 1000), (0, 16), ((0,), (2,)))
    seq_ub, pooled_ub = seq.table_load("t", ub), pooled.table_load("t", ub)
    for row in ("send_intra", "send_inter", "recv_intra", "recv_inter", "lookup_bytes", "host_ms"):
        np.testing.assert_array_equal(getattr(seq_ub, row), getattr(pooled_ub, row))
    dp = seq.table_load("t", TableLayout.data_parallel())
    assert not (dp.send_intra + dp.send_inter + dp.recv_intra + dp.recv_inter).any()


def test_repeats_make_unique_based_cheaper_for_sequence_tables_on_cpu() -> None:
    """On cpu-gloo, an RB sequence table's senders route and place every ID as UB's de-duplicate and expand them, so
    between the two only the repeats differ: UB costs less the more IDs repeat, and about the same without repeats."""

    def step(kind: str, cluster: str, ratio: float) -> float:
        cost = _one_table(kind, pooling=50.0, unique_ratio=ratio)
        layout = TableLayout(cluster, (0, 250, 500, 750, 1000), (0, 16), ((0,), (1,), (2,), (3,)))
        return cost.evaluate(Plan(4, 2, {"t": layout})).step_ms

    assert step("sequence", "ub", 0.3) < step("sequence", "rb", 0.3)
    assert step("sequence", "ub", 1.0) == pytest.approx(step("sequence", "rb", 1.0), rel=0.1)


@pytest.mark.parametrize(
    "layout",
    [
        TableLayout("rb", (0, 250, 1000), (0, 4, 16), ((0, 1), (3, 2)), WirePrecision("fp8", "fp16")),
        TableLayout("rb", (0, 400, 1000), (0, 16), ((1,), (2,)), hierarchical=True),
        TableLayout("ub", (0, 400, 1000), (0, 8, 16), ((0, 3), (2, 1))),
        TableLayout.table_wise(1000, 16, 3),
    ],
    ids=["grid-fp8", "rows-hier", "ub-grid", "tw"],
)
def test_traffic_messages_add_up_to_the_cost_model(layout: TableLayout) -> None:
    """Per rank, bytes sent and received intra and inter node: the messages summed equal the closed forms."""
    cost = _one_table("sequence")
    topo = cost.topology
    load = cost.table_load("t", layout)
    got = np.zeros((4, 4))  # send intra, recv intra, send inter, recv inter
    for m in table_messages(cost, "t", layout):
        inter = 2 * (topo.node_of(m.src) != topo.node_of(m.dst))
        got[inter, m.src] += m.nbytes
        got[inter + 1, m.dst] += m.nbytes
    want = np.stack([load.send_intra, load.recv_intra, load.send_inter, load.recv_inter])
    np.testing.assert_allclose(got, want)


# ---------------------------------------------------------------- planner choices


class Nested(nn.Module):
    """An EBC two levels down and an EC beside it; both hold a table named "shared" (the EC's named `shared_as`)."""

    def __init__(self, device: torch.device, rows: int = 60, shared_as: str = "shared") -> None:
        super().__init__()
        self.sparse = nn.Module()
        self.sparse.bags = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="shared", num_embeddings=rows, embedding_dim=DIM, feature_names=["b0"]),
                EmbeddingBagConfig(name="bag", num_embeddings=40, embedding_dim=DIM, feature_names=["b1", "b2"]),
            ],
            device=device,
        )
        self.history = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=shared_as, num_embeddings=rows, embedding_dim=DIM, feature_names=["s0"]),
                EmbeddingConfig(name="seq", num_embeddings=50, embedding_dim=DIM, feature_names=["s1", "s2"]),
                EmbeddingConfig(name="grid", num_embeddings=36, embedding_dim=DIM, feature_names=["s3"]),
            ],
            device=device,
        )

    def forward(self, bags: KeyedJaggedTensor, seqs: KeyedJaggedTensor) -> tuple[Any, Any]:
        return self.sparse.bags(bags), self.history(seqs)


# constraints make the search use our sequence types too (it would put these small tables table-wise)
CONSTRAINTS = {
    "seq": TableConstraints(cluster="ub", min_cuts=(2, 1)),
    "grid": TableConstraints(cluster="rb", min_cuts=(1, 2)),  # column slices: our grid type for a sequence table
    "bag": TableConstraints(cluster="rb"),
}


def _sharders() -> list[Any]:
    fused = {"optimizer": OPTIMIZERS["sgd"], "learning_rate": LR}
    return [
        EmbarkEmbeddingBagCollectionSharder(fused_params=fused),
        EmbarkEmbeddingCollectionSharder(fused_params=fused),
    ]


def test_planner_plans_both_collections_in_one_search_and_only_those_it_may() -> None:
    planner = EmbarkPlanner(
        world_size=4, local_world_size=2, batch_size=BATCH, compute_device="cpu", constraints=CONSTRAINTS
    )
    plan = planner.plan(Nested(torch.device("meta")), _sharders())
    assert set(plan.plan) == {"sparse.bags", "history"}
    assert set(plan.plan["history"]) == {"shared", "seq", "grid"} and set(plan.plan["sparse.bags"]) == {"shared", "bag"}
    assert plan.plan["history"]["seq"].sharding_type == "embark_ub"
    assert plan.plan["history"]["grid"].sharding_type == "embark_rb"
    assert planner.plans["history"].plan.kinds == {"shared": "sequence", "seq": "sequence", "grid": "sequence"}
    assert all(ps.sharding_type != "data_parallel" for ps in plan.plan["history"].values())  # CPU: no DP sequence
    assert "1 sequence tables" not in planner.report() and "3 sequence tables" in planner.report()
    only_bags = EmbarkPlanner(world_size=4, local_world_size=2, batch_size=BATCH, compute_device="cpu")
    assert set(only_bags.plan(Nested(torch.device("meta")), _sharders()[:1]).plan) == {"sparse.bags"}
    with pytest.raises(ValueError, match="pass EmbarkEmbeddingCollectionSharder"):
        EmbarkPlanner(
            world_size=4, local_world_size=2, batch_size=BATCH, compute_device="cpu", constraints=CONSTRAINTS
        ).plan(Nested(torch.device("meta")), [_sharders()[0], EmbeddingCollectionSharder()])


# ---------------------------------------------------------------- load_plan and the TorchRec baseline


def _planned_file(path: Any) -> ShardingPlan:
    """EmbarkPlanner's plan of Nested (no table name in both collections), its modules' plans saved as one plan
    file at `path`; returns the ShardingPlan the planner gave."""
    planner = EmbarkPlanner(
        world_size=4, local_world_size=2, batch_size=BATCH, compute_device="cpu", constraints=CONSTRAINTS
    )
    planned = planner.plan(Nested(torch.device("meta"), shared_as="recent"), _sharders())
    plans = [p.plan for p in planner.plans.values()]
    tables = {name: layout for p in plans for name, layout in p.tables.items()}
    Plan(4, 2, tables, {name: kind for p in plans for name, kind in p.kinds.items()}).save(path)
    return planned


def test_load_plan_loads_a_planned_ebc_and_ec_into_the_planners_sharding_plan(tmp_path: Any) -> None:
    path = tmp_path / "plan.json"
    planned = _planned_file(path)
    loaded = load_plan(path, Nested(torch.device("meta"), shared_as="recent"), world_size=4, compute_device="cpu")
    assert loaded.plan == planned.plan
    assert loaded.plan["history"]["seq"].sharding_type == "embark_ub"  # not vacuous: our sequence types, by path
    assert set(loaded.plan) == {"sparse.bags", "history"} and Plan.load(path).kinds["seq"] == "sequence"


@pytest.mark.parametrize(
    "table, edit, message",
    [
        (
            "bag",
            {"kind": "sequence"},
            "EmbeddingBagCollection at 'sparse.bags': table 'bag': the plan is for a sequence",
        ),
        ("seq", {"kind": "pooled"}, "EmbeddingCollection at 'history': table 'seq': the plan is for a pooled table"),
        ("seq", None, r"EmbeddingCollection at 'history': the plan has no layout for tables \['seq'\]"),
    ],
    ids=["pooled_as_sequence", "sequence_as_pooled", "missing"],
)
def test_load_plan_names_the_file_module_and_table_of_a_wrong_kind_or_missing_table(
    tmp_path: Any, table: str, edit: dict[str, str] | None, message: str
) -> None:
    path = tmp_path / "plan.json"
    _planned_file(path)
    doc = json.loads(path.read_text())
    if edit is None:
        del doc["tables"][table]
    else:
        doc["tables"][table].update(edit)
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=f"^{re.escape(str(path))}: {message}"):
        load_plan(path, Nested(torch.device("meta"), shared_as="recent"), world_size=4, compute_device="cpu")


def test_cli_compares_with_torchrec_planning_sequence_tables_as_an_embedding_collection(
    tmp_path: Any, capsys: Any, monkeypatch: Any
) -> None:
    """--compare torchrec (python -m embark_torchrec.planner) runs TorchRec's planner on an EmbeddingCollection for
    the sequence table (with TorchRec's EmbeddingCollectionSharder), so its plan uses a type TorchRec's EC runs; our
    cost model scores it as sequence."""
    seen: list[ShardingPlan] = []

    class Recording(torchrec_plans.EmbeddingShardingPlanner):
        def plan(self, module: nn.Module, sharders: list[Any]) -> ShardingPlan:
            seen.append(super().plan(module, sharders))
            return seen[-1]

    monkeypatch.setattr(torchrec_plans, "EmbeddingShardingPlanner", Recording)
    path = tmp_path / "seq.json"
    path.write_text(json.dumps(SEQUENCE_AND_BAG))
    argv = [str(path), "--world-size", "4", "--local-world-size", "2", "--hardware", "cpu-gloo"]
    assert planner_cli.main([*argv, "--compare", "torchrec", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)["plans"]["torchrec"]
    assert scored["sequence_tables"] == 1
    (theirs,) = seen
    assert set(theirs.plan["sequence"]) == {"hist"} and set(theirs.plan["pooled"]) == {"bag"}
    assert theirs.plan["sequence"]["hist"].sharding_type in EmbeddingCollectionSharder().sharding_types("cuda")


# ---------------------------------------------------------------- on ranks (module level: must pickle)


def _loss(bags: Any, seqs: Any) -> torch.Tensor:
    bags = bags.wait() if hasattr(bags, "wait") else bags
    seqs = seqs.wait() if hasattr(seqs, "wait") else seqs
    return (bags.values() ** 2).sum() + sum((jt.values() ** 2).sum() for jt in dict(seqs).values())


def _planned_training(lws: int) -> dict[str, float]:
    """Max |sharded - unsharded| of the loss at two steps and of every weight after them."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(ws)
    reference = Nested(torch.device("cpu"))
    planner = EmbarkPlanner(
        world_size=ws, local_world_size=lws, batch_size=BATCH, compute_device="cpu", constraints=CONSTRAINTS
    )
    model = DistributedModelParallel(
        Nested(torch.device("meta")),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=planner.collective_plan(Nested(torch.device("meta")), _sharders()),
        sharders=_sharders(),
        device=torch.device("cpu"),
    )
    copy_global_weights(model, reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))  # data-parallel tables, if any
    dense_opt = torch.optim.SGD(dense.values(), lr=LR) if dense else None
    diffs: dict[str, float] = {}
    for step in range(2):
        bags = global_kjt_batch(list(reference.sparse.bags.embedding_bag_configs()), ws, BATCH, seed=10 + step)
        seqs = global_kjt_batch(list(reference.history.embedding_configs()), ws, BATCH, seed=20 + step, ids="zipf")
        ref_opt.zero_grad()
        losses = [_loss(*reference(bags[r], seqs[r])) for r in range(ws)]
        (sum(losses) / ws).backward()
        ref_opt.step()
        loss = _loss(*model(bags[rank], seqs[rank]))
        loss.backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
        diffs[f"loss{step}"] = abs(float(loss) - float(losses[rank])) / max(1.0, abs(float(losses[rank])))
    diffs.update(weight_diffs(model, reference.state_dict()))
    return diffs


TABLES = [
    EmbeddingConfig(name="grid", num_embeddings=40, embedding_dim=DIM, feature_names=["g0", "g1"]),
    EmbeddingConfig(name="rows", num_embeddings=37, embedding_dim=DIM, feature_names=["r"]),
    EmbeddingConfig(name="hier", num_embeddings=32, embedding_dim=DIM, feature_names=["h"]),
    EmbeddingConfig(name="ub_grid", num_embeddings=24, embedding_dim=DIM, feature_names=["u0", "u1"]),
    EmbeddingConfig(name="ub_rows", num_embeddings=30, embedding_dim=DIM, feature_names=["q"]),
    EmbeddingConfig(name="rb_fp8", num_embeddings=28, embedding_dim=DIM, feature_names=["e"]),
]


def _layouts(ws: int) -> dict[str, TableLayout]:
    last = ws - 1
    return {
        "grid": TableLayout("rb", (0, 13, 40), (0, 4, DIM), ((0, 1), (last, 0))),
        "rows": TableLayout("rb", (0, 3, 20, 37), (0, DIM), ((1,), (0,), (last,))),
        "hier": TableLayout("rb", (0, 16, 32), (0, DIM), ((0,), (last,)), hierarchical=True),
        "ub_grid": TableLayout("ub", (0, 12, 24), (0, 4, DIM), ((last, 0), (0, last))),
        "ub_rows": TableLayout("ub", (0, 5, 30), (0, DIM), ((0,), (last,)), WirePrecision("fp16", "bf16")),
        "rb_fp8": TableLayout("rb", (0, 14, 28), (0, DIM), ((last,), (0,)), WirePrecision("fp8", "fp8")),
    }


def _batches(ws: int) -> list[KeyedJaggedTensor]:
    """The global batch, with int32 lengths (what the cost model assumes on the wire)."""
    return [
        KeyedJaggedTensor(keys=k.keys(), values=k.values(), lengths=k.lengths().to(torch.int32), stride=BATCH)
        for k in global_kjt_batch(TABLES, ws, BATCH, seed=7, ids="zipf", max_bag_size=6)
    ]


def _counted_bytes(lws: int) -> dict[tuple[str, str], np.ndarray]:
    """One training step's counted bytes per (table, kind): [2, W] sent to / received from each peer."""
    rank = dist.get_rank()
    model = sharded_sequence_model(TABLES, _layouts(dist.get_world_size()), lws)
    stats = enable_comm_stats(model)
    out = model(_batches(dist.get_world_size())[rank])
    out = out.wait() if hasattr(out, "wait") else out
    sum((jt.values() ** 2).sum() for jt in dict(out).values()).backward()
    counted: dict[tuple[str, str], np.ndarray] = {}
    for k in stats.keys():
        if k.kind not in KINDS:  # the split exchange's metadata, which the planner does not price
            continue
        assert k.table != ALL_TABLES, k  # our sequence types count per table
        counted[(k.table, k.kind)] = counted.get((k.table, k.kind), 0) + stats.per_peer(k)
    return counted


def _run_world(lws: int) -> dict[str, Any]:
    return {"training": _planned_training(lws), "bytes": _counted_bytes(lws)}


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda ws: f"{ws}ranks")
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ws = request.param
    return ws, run_ranks(_run_world, ws, args=(WORLDS[ws],), local_world_size=WORLDS[ws], timeout_s=400)


def test_planned_ebc_and_ec_train_exactly_as_unsharded(world: tuple[int, list[dict[str, Any]]]) -> None:
    """EmbarkPlanner's plan of the nested EBC + EC model, run by DMP with both Embark sharders: the loss at both
    steps and every weight after them (each rank's shards) equal the unsharded model's."""
    ws, results = world
    for rank, result in enumerate(results):
        diffs = result["training"]
        assert {"weight/history.embeddings.seq.weight", "weight/sparse.bags.embedding_bags.bag.weight"} <= set(diffs)
        bad = {k: v for k, v in diffs.items() if not v <= ATOL}
        assert not bad, (ws, rank, bad)


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_counted_bytes_equal_the_traffic_model(world: tuple[int, list[dict[str, Any]]], table: EmbeddingConfig) -> None:
    """Per rank, peer and kind, the EC's counted bytes equal traffic.table_messages for the batch's IDs, exactly."""
    ws, results = world
    spec = ModelSpec(
        name="m",
        batch_size=ws * BATCH,
        tables=tuple(
            TableSpec(
                name=t.name,
                rows=t.num_embeddings,
                dim=DIM,
                pooling=1.0,
                feature_names=tuple(t.feature_names),
                kind="sequence",
            )
            for t in TABLES
        ),
    )
    cost = CostModel(spec, Topology(ws, WORLDS[ws]))
    layout = _layouts(ws)[table.name]
    predicted = {kind: np.zeros((ws, 2, ws)) for kind in KINDS}
    ids = ids_per_row_slice(_batches(ws), table.feature_names, layout.row_bounds, layout.cluster == "ub")
    for m in table_messages(cost, table.name, layout, ids):
        predicted[m.kind][m.src, 0, m.dst] += m.nbytes
        predicted[m.kind][m.dst, 1, m.src] += m.nbytes
    for kind in KINDS:
        assert predicted[kind].sum() > 0, (table.name, kind)  # not vacuous
        for rank, result in enumerate(results):
            counted = result["bytes"].get((table.name, kind), np.zeros((2, ws)))
            np.testing.assert_array_equal(counted, predicted[kind][rank], err_msg=f"{table.name} {kind} rank {rank}")
