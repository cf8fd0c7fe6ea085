"""A torch.distributed.checkpoint of a sharded EmbeddingCollection moves between plans without changing a bit.

Spawn 1, 4 ranks (2 nodes x 2): an EC sharded by a grid plan (a 2 x 2 grid with uneven rows, an uneven row split,
column slices on two ranks) trains two fused SGD steps and is saved (checkpoint A, and on the side the full tensors).
A is loaded into fresh models (other random weights) sharded by TorchRec's table-wise plan, by a unique-based plan and
by another grid plan (other cuts, other ranks, several cells of one table on one rank). Spawn 2, 2 ranks: A is loaded
(4 -> 2 ranks) into a grid plan and a unique-based plan for 2 ranks.

Loading follows TorchRec's documented path: dcp.load into the fresh model's live state dict, then
model.load_state_dict. Checked, bit for bit in fp32: every element of every table as the model then reports it
(freshly taken state dict, every element held exactly once over the ranks); and each rank's output vectors per feature
on a batch with empty sequences equal those of an unsharded EmbeddingCollection holding the saved weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec.modules.embedding_configs import EmbeddingConfig

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.sharding.sharded_ec import EmbarkShardedEmbeddingCollection
from embark_torchrec.sharding.torchrec_compat import sequence_sharding_types
from embark_torchrec.testing import global_kjt_batch, run_ranks
from tests.support.checkpoints import compare_with_full, gather_full
from embark_torchrec.testing.sequence import SequenceArch, sharded_sequence_model

pytestmark = pytest.mark.torchrec_version

DIM, BATCH = 16, 4
LOCAL = {4: 2, 2: 1}  # world size -> local world size
TABLES = [
    EmbeddingConfig(name="a", num_embeddings=40, embedding_dim=DIM, feature_names=["a_f0", "a_f1"]),
    EmbeddingConfig(name="b", num_embeddings=24, embedding_dim=DIM, feature_names=["b_f0"]),
    EmbeddingConfig(name="c", num_embeddings=30, embedding_dim=DIM, feature_names=["c_f0"]),
]
SOURCE = {
    "a": TableLayout("rb", (0, 13, 40), (0, 8, DIM), ((0, 1), (3, 2))),
    "b": TableLayout("rb", (0, 7, 24), (0, DIM), ((1,), (2,))),
    "c": TableLayout("rb", (0, 30), (0, 4, DIM), ((3, 0),)),
}
TARGETS: dict[int, dict[str, dict[str, TableLayout]]] = {
    4: {
        "table_wise": {t.name: TableLayout.table_wise(t.num_embeddings, DIM, i + 1) for i, t in enumerate(TABLES)},
        "ub": {
            "a": TableLayout("ub", (0, 20, 40), (0, 4, DIM), ((2, 0), (1, 3))),
            "b": TableLayout("ub", (0, 24), (0, DIM), ((3,),)),
            "c": TableLayout("ub", (0, 11, 30), (0, DIM), ((1,), (3,))),
        },
        "grid": {
            "a": TableLayout("rb", (0, 5, 29, 40), (0, 12, DIM), ((3, 1), (0, 2), (3, 1))),
            "b": TableLayout("rb", (0, 24), (0, 4, DIM), ((0, 2),)),
            "c": TableLayout("rb", (0, 17, 30), (0, 8, DIM), ((2, 1), (1, 1))),
        },
    },
    2: {
        "grid": {
            "a": TableLayout("rb", (0, 31, 40), (0, 8, DIM), ((1, 0), (1, 1))),
            "b": TableLayout("rb", (0, 3, 24), (0, DIM), ((1,), (0,))),
            "c": TableLayout("rb", (0, 30), (0, 12, DIM), ((0, 1),)),
        },
        "ub": {
            "a": TableLayout("ub", (0, 9, 40), (0, DIM), ((1,), (0,))),
            "b": TableLayout("ub", (0, 24), (0, 8, DIM), ((0, 1),)),
            "c": TableLayout("ub", (0, 30), (0, DIM), ((1,),)),
        },
    },
}
EXPECTED_TYPES = {"table_wise": ["table_wise"], "ub": ["embark_ub"], "grid": ["embark_rb"]}


# ---------------------------------------------------------------- in each rank (module level: must pickle)


def _types(model: torch.nn.Module) -> list[str]:
    (module,) = [m for m in model.modules() if isinstance(m, EmbarkShardedEmbeddingCollection)]
    return sorted(sequence_sharding_types(module))


def _load_into(layouts: dict[str, TableLayout], checkpoint: str, saved: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A fresh model sharded by `layouts` loads `checkpoint`; its weights and outputs against the saved ones."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(100 + ws)
    model = sharded_sequence_model(TABLES, layouts, LOCAL[ws])
    state = {"model": model.state_dict()}
    before = compare_with_full(state, saved)
    dcp.load(state, checkpoint_id=checkpoint)
    model.load_state_dict(state["model"])
    fresh = {"model": model.state_dict()}
    after = compare_with_full(fresh, saved)
    whole = gather_full(fresh)  # raises unless every element of every table is held exactly once
    reference = SequenceArch(TABLES, torch.device("cpu"))
    reference.load_state_dict({path.removeprefix("model/"): value for path, value in saved.items()})
    batch = global_kjt_batch(TABLES, ws, BATCH, seed=77)[rank]
    with torch.no_grad():
        got, want = model(batch), reference(batch)
        got = got.wait() if hasattr(got, "wait") else got
    outputs = {
        k: int((got[k].values().view(torch.int32) != want[k].values().view(torch.int32)).sum())
        if torch.equal(got[k].lengths(), want[k].lengths()) and got[k].values().shape == want[k].values().shape
        else -1
        for k in want
    }
    return {
        "types": _types(model),
        "before": {p: r["differing"] for p, r in before.items()},
        "after": {p: (r["differing"], r["elements"]) for p, r in after.items()},
        "whole": {p: int((v.view(torch.int32) != saved[p].view(torch.int32)).sum()) for p, v in whole.items()},
        "outputs": outputs,
        "ids": int(batch.values().numel()),
    }


def _save_and_load(directory: str) -> dict[str, Any]:
    """4 ranks: train under SOURCE, save A and its full tensors, load A into every 4-rank target."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = sharded_sequence_model(TABLES, SOURCE, LOCAL[4])
    start = gather_full({"model": model.state_dict()})
    for step in range(2):
        out = model(global_kjt_batch(TABLES, 4, BATCH, seed=step, ids="zipf")[rank])
        out = out.wait() if hasattr(out, "wait") else out
        sum((jt.values() ** 2).sum() for jt in out.values()).backward()
    state = {"model": model.state_dict()}
    saved = gather_full(state)
    dcp.save(state, checkpoint_id=f"{directory}/A")
    if rank == 0:
        torch.save(saved, f"{directory}/A_full.pt")
    dist.barrier()
    return {
        "source_types": _types(model),
        "trained": {p: float((saved[p] - start[p]).abs().max()) for p in saved},
        **{kind: _load_into(layouts, f"{directory}/A", saved) for kind, layouts in TARGETS[4].items()},
    }


def _load_on_two(directory: str) -> dict[str, Any]:
    saved = torch.load(f"{directory}/A_full.pt")
    return {kind: _load_into(layouts, f"{directory}/A", saved) for kind, layouts in TARGETS[2].items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    directory = str(tmp_path_factory.mktemp("ec_dcp"))
    four = run_ranks(_save_and_load, 4, args=(directory,), local_world_size=LOCAL[4], timeout_s=300)
    two = run_ranks(_load_on_two, 2, args=(directory,), local_world_size=LOCAL[2], timeout_s=300)
    return {4: four, 2: two}


def test_source_is_a_trained_grid(results: dict[int, list[dict[str, Any]]]) -> None:
    """The saved model ran on our grid sharding and its two steps changed every table (the checkpoint is not just
    initial weights)."""
    for r in results[4]:
        assert r["source_types"] == ["embark_rb"]
        assert all(v > 1e-4 for v in r["trained"].values()), r["trained"]


@pytest.mark.parametrize("target", [f"{kind}@{ws}" for ws in (4, 2) for kind in TARGETS[ws]])
def test_checkpoint_loads_into_other_plans(results: dict[int, list[dict[str, Any]]], target: str) -> None:
    """Into a model sharded by another plan (its sharding type as intended), loading A makes every element of
    every table bitwise the saved one, on every rank's cells and over all ranks (each element held once); the
    fresh model differed before loading; its output vectors and lengths per feature then equal, bitwise, those of
    an unsharded EmbeddingCollection holding the saved weights."""
    kind, ws = target.split("@")
    paths = {f"model/ec.embeddings.{t.name}.weight" for t in TABLES}
    held = dict.fromkeys(paths, 0)
    for rank, r in enumerate(results[int(ws)]):
        report = r[kind]
        assert report["types"] == EXPECTED_TYPES[kind], (rank, report["types"])
        assert set(report["after"]) == paths, (rank, sorted(report["after"]))
        assert all(differing == 0 for differing, _ in report["after"].values()), (rank, report["after"])
        assert report["whole"] == dict.fromkeys(paths, 0), (rank, report["whole"])
        assert report["outputs"] == {f: 0 for t in TABLES for f in t.feature_names}, (rank, report["outputs"])
        assert report["ids"] > 0, rank
        for p, (_, elements) in report["after"].items():
            held[p] += elements
    assert held == {f"model/ec.embeddings.{t.name}.weight": t.num_embeddings * DIM for t in TABLES}
    assert any(d > 0 for r in results[int(ws)] for d in r[kind]["before"].values())


def test_hand_made_sequence_plan_with_mixed_widths_on_a_rank_is_refused_by_name() -> None:
    """A plan giving one rank two cells of one table in different widths (which TorchRec's fused optimizer cannot
    hold) fails in sequence_sharding_plan with a PlanError naming table and rank, not inside TorchRec."""
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from embark_torchrec.plan.layout.tables import Plan, PlanError
    from embark_torchrec.planner.parameter_sharding import sequence_sharding_plan

    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="t", num_embeddings=40, embedding_dim=16, feature_names=["f"])],
        device=torch.device("meta"),
    )
    plan = Plan(2, 2, {"t": TableLayout("rb", (0, 40), (0, 4, 16), ((0, 0),))})
    with pytest.raises(PlanError, match="table 't'.*rank 0.*widths"):
        sequence_sharding_plan(plan, ec, "cpu")
