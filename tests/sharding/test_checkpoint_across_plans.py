"""A torch.distributed.checkpoint of a trained model moves between plans and world sizes without changing a bit.

The chain, one spawn per step (a directory shared between spawns holds the checkpoints and, on the side, the full
tensors each one holds):

1. 4 ranks (2 nodes x 2), an EMBark plan with a 2x2 grid, a hierarchical 2x2 grid, a unique-based grid (one rank
   holds two of its cells), a data-parallel and a table-wise table: three training steps (fused EXACT_ADAGRAD,
   dense Adagrad), save checkpoint A. Load A into the same model sharded by TorchRec's default plan
   (EmbeddingShardingPlanner with our sharder, CPU topology).
2. 2 ranks (2 nodes x 1): load A (4 -> 2) into an EMBark plan for 2 ranks (other grids, a UB grid with two cells on
   one rank, a column-wise table) and into TorchRec's default plan. Train the EMBark-planned model two more steps
   and compare with an unsharded model continuing from A's tensors; save checkpoint B.
3. 4 ranks: load B (2 -> 4) back into the first EMBark plan, and into TorchRec's default plan.

What is compared, bit for bit in fp32: every element of every table's weights; the fused optimizer's state of
every model-parallel table (EXACT_ADAGRAD's per-element momentum1, reshardable with the weights); and the dense
optimizer's state of the data-parallel table (torch Adagrad's sum and step), which lives in the dense optimizer,
not in DMP's fused one. A trainer saves {"model": model.state_dict(), "fused": model.fused_optimizer's state,
"dense": its dense KeyedOptimizer's state} (support/checkpoints.py: training_state). The DP table stays data-parallel
in every plan here: moving a table between data-parallel and model-parallel would move its optimizer state between
the two optimizers under different names, which torchrec does not map (out of scope). Loading follows torchrec's
documented path: dcp.load into the target's live state dicts, then model.load_state_dict and both optimizers'
load_state_dict; the checks then read freshly taken state dicts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.testing import run_ranks
from tests.support.checkpoints import (
    compare_with_full,
    dense_optimizer,
    embark_sharding_plan,
    gather_full,
    load_training_state,
    shard,
    torchrec_sharding_plan,
    train_steps,
    training_state,
    unsharded_steps,
)

BATCH = 4
FIRST_STEPS, MORE_STEPS = 3, 2
LOCAL = {4: 2, 2: 1}  # world size -> local world size
TABLES = [
    EmbeddingBagConfig(name="grid", num_embeddings=40, embedding_dim=16, feature_names=["grid_a", "grid_b"]),
    EmbeddingBagConfig(name="hier", num_embeddings=36, embedding_dim=8, feature_names=["hier_f"]),
    EmbeddingBagConfig(name="ub", num_embeddings=24, embedding_dim=8, feature_names=["ub_f"]),
    EmbeddingBagConfig(name="dp", num_embeddings=10, embedding_dim=4, feature_names=["dp_f"]),
    EmbeddingBagConfig(name="tw", num_embeddings=20, embedding_dim=12, feature_names=["tw_f"]),
]
EMBARK = {
    4: {
        "grid": TableLayout("rb", (0, 13, 40), (0, 8, 16), ((0, 1), (3, 2))),
        "hier": TableLayout("rb", (0, 20, 36), (0, 4, 8), ((1, 2), (3, 0)), hierarchical=True),
        "ub": TableLayout("ub", (0, 12, 24), (0, 4, 8), ((3, 0), (0, 2))),
        "dp": TableLayout.data_parallel(),
        "tw": TableLayout.table_wise(20, 12, 2),
    },
    2: {
        "grid": TableLayout("rb", (0, 25, 40), (0, 4, 16), ((1, 0), (1, 0))),
        "hier": TableLayout("rb", (0, 9, 36), (0, 4, 8), ((0, 1), (1, 0)), hierarchical=True),
        "ub": TableLayout("ub", (0, 7, 24), (0, 4, 8), ((1, 0), (0, 0))),
        "dp": TableLayout.data_parallel(),
        "tw": TableLayout("rb", (0, 20), (0, 4, 12), ((1, 0),)),
    },
}
_MODEL_PARALLEL = ["table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"]
# TorchRec's planner picks freely among its model-parallel types; only the DP table is held to data_parallel
TORCHREC_CONSTRAINTS = {
    t.name: ParameterConstraints(sharding_types=["data_parallel"] if t.name == "dp" else _MODEL_PARALLEL)
    for t in TABLES
}
TARGETS = ["torchrec@4", "embark@2", "torchrec@2", "embark@4-back", "torchrec@4-back"]


# ---------------------------------------------------------------- in each rank (module level: must pickle)


def _sharding_plan(kind: str) -> Any:
    ws = dist.get_world_size()
    if kind == "embark":
        return embark_sharding_plan(TABLES, EMBARK[ws], LOCAL[ws])
    return torchrec_sharding_plan(TABLES, LOCAL[ws], TORCHREC_CONSTRAINTS, batch_size=BATCH)


def _load_into(
    kind: str, checkpoint: str, saved: dict[str, torch.Tensor], seed: int
) -> tuple[Any, Any, dict[str, Any]]:
    """A fresh model (other weights, zero optimizer states) sharded by `kind`'s plan loads `checkpoint`; returns the
    model, its dense optimizer and what the checks need."""
    plan = _sharding_plan(kind)
    torch.manual_seed(seed)
    model = shard(TABLES, plan)
    dense = dense_optimizer(model)
    state = training_state(model, dense)
    before = compare_with_full(state, saved)
    dcp.load(state, checkpoint_id=checkpoint)  # in place, into the live tensors
    load_training_state(model, dense, state)
    fresh = training_state(model, dense)  # read back from the model and the optimizers, not from `state`
    after = compare_with_full(fresh, saved)
    loaded = gather_full(fresh)  # raises unless every element of every table is held exactly once
    whole = {
        p: int((v.contiguous().view(torch.int32) != saved[p].contiguous().view(torch.int32)).sum())
        for p, v in loaded.items()
    }
    report = {
        "shardings": {name: ps.sharding_type for name, ps in plan.plan["ebc"].items()},
        "before": {p: r["differing"] for p, r in before.items()},
        "after": after,
        "whole": whole,
    }
    return model, dense, report


def _first(directory: str) -> dict[str, Any]:
    """4 ranks: train under the EMBark plan, save A and its full tensors; load A into TorchRec's plan."""
    plan = embark_sharding_plan(TABLES, EMBARK[4], LOCAL[4])
    torch.manual_seed(0)
    model = shard(TABLES, plan)
    dense = dense_optimizer(model)
    losses = train_steps(model, dense, TABLES, FIRST_STEPS, seed=11, batch_per_rank=BATCH, ids="zipf")
    state = training_state(model, dense)
    saved = gather_full(state)
    dcp.save(state, checkpoint_id=f"{directory}/A")
    if dist.get_rank() == 0:
        torch.save(saved, f"{directory}/A_full.pt")
    dist.barrier()
    _, _, report = _load_into("torchrec", f"{directory}/A", saved, seed=100)
    return {
        "source_shardings": {name: ps.sharding_type for name, ps in plan.plan["ebc"].items()},
        "losses": losses,
        "saved": saved if dist.get_rank() == 0 else None,
        "torchrec@4": report,
    }


def _second(directory: str) -> dict[str, Any]:
    """2 ranks: load A into the EMBark 2-rank plan and into TorchRec's; train on, compare with unsharded; save B."""
    saved = torch.load(f"{directory}/A_full.pt")
    out: dict[str, Any] = {}
    _, _, out["torchrec@2"] = _load_into("torchrec", f"{directory}/A", saved, seed=200)
    model, dense, out["embark@2"] = _load_into("embark", f"{directory}/A", saved, seed=300)
    train_steps(model, dense, TABLES, MORE_STEPS, seed=22, batch_per_rank=BATCH, ids="zipf")
    state = training_state(model, dense)
    trained = gather_full(state)
    if dist.get_rank() == 0:
        expected = unsharded_steps(TABLES, saved, MORE_STEPS, seed=22, world_size=2, batch_per_rank=BATCH, ids="zipf")
        out["resumed"] = {
            p: (
                float((trained[p].double() - v.double()).abs().max()),
                float(v.double().abs().max()),
                float((v.double() - saved[p].double()).abs().max()),
            )
            for p, v in expected.items()
        }
    dcp.save(state, checkpoint_id=f"{directory}/B")
    if dist.get_rank() == 0:
        torch.save(trained, f"{directory}/B_full.pt")
    dist.barrier()
    return out


def _third(directory: str) -> dict[str, Any]:
    """4 ranks: load B (saved by 2 ranks) into the first EMBark plan and into TorchRec's plan."""
    saved = torch.load(f"{directory}/B_full.pt")
    out: dict[str, Any] = {}
    _, _, out["embark@4-back"] = _load_into("embark", f"{directory}/B", saved, seed=400)
    _, _, out["torchrec@4-back"] = _load_into("torchrec", f"{directory}/B", saved, seed=500)
    return out


# ---------------------------------------------------------------- the chain of spawns


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = str(tmp_path_factory.mktemp("dcp_across_plans"))
    first = run_ranks(_first, 4, local_world_size=LOCAL[4], timeout_s=300, args=(directory,))
    second = run_ranks(_second, 2, local_world_size=LOCAL[2], timeout_s=300, args=(directory,))
    third = run_ranks(_third, 4, local_world_size=LOCAL[4], timeout_s=300, args=(directory,))
    per_rank = {"torchrec@4": [r["torchrec@4"] for r in first]}
    for results in (second, third):
        for key in results[0]:
            if key != "resumed":
                per_rank[key] = [r[key] for r in results]
    return {"first": first, "second": second, "third": third, "targets": per_rank}


def test_source_plan_and_checkpoint_are_not_trivial(chain: dict[str, Any]) -> None:
    """The saved model was sharded by EMBark's own shardings (a flat grid, a hierarchical grid, a unique-based grid)
    plus DP and table-wise, and had trained: non-zero Adagrad state in every table, dense step count 3."""
    first = chain["first"]
    assert first[0]["source_shardings"] == {
        "grid": "embark_rb",
        "hier": "embark_rb_hier",
        "ub": "embark_ub",
        "dp": "data_parallel",
        "tw": "table_wise",
    }
    saved = first[0]["saved"]
    for t in TABLES:
        key = (
            f"dense/ebc.embedding_bags.{t.name}.weight/sum"
            if t.name == "dp"
            else f"fused/ebc.embedding_bags.{t.name}.weight/{t.name}.momentum1"
        )
        assert saved[key].shape == (t.num_embeddings, t.embedding_dim) and bool((saved[key] > 0).any()), key
    assert float(saved["dense/ebc.embedding_bags.dp.weight/step"]) == FIRST_STEPS


@pytest.mark.parametrize("target", TARGETS)
def test_checkpoint_loads_bit_for_bit(target: str, chain: dict[str, Any]) -> None:
    """After loading, the model sharded by the target plan (TorchRec's default plan at 4 ranks; 4 -> 2 into an EMBark
    plan and TorchRec's; 2 -> 4 back into the first EMBark plan and TorchRec's) holds every weight element and every
    optimizer state (fused momentum1 of each model-parallel table, dense sum and step of the DP table) equal bit for
    bit to what was saved: checked per rank on its own shards, and on the whole tensors gathered from all ranks,
    which must cover each table exactly once. Not vacuous: before loading every tensor differed somewhere."""
    reports = chain["targets"][target]
    saved_paths = set(reports[0]["whole"])
    assert {p.split("/")[0] for p in saved_paths} == {"model", "fused", "dense"}
    assert len(saved_paths) == 2 * len(TABLES) + 1  # weights, 4 momentum1, dense sum and step
    for rank, report in enumerate(reports):
        bad = {p: r["differing"] for p, r in report["after"].items() if r["differing"]}
        assert not bad, (target, rank, bad)
        assert report["whole"] == dict.fromkeys(saved_paths, 0), (target, rank, report["whole"])
    for path in saved_paths:
        assert sum(report["before"].get(path, 0) for report in reports) > 0, (target, path)
    elements = {p: sum(r["after"][p]["elements"] for r in reports if p in r["after"]) for p in saved_paths}
    for t in TABLES:  # each model-parallel element compared on exactly one rank, replicated ones on every rank
        for p, n in elements.items():
            if f".{t.name}.weight" in p and not p.endswith("/step"):
                assert n == t.num_embeddings * t.embedding_dim * (len(reports) if t.name == "dp" else 1), (target, p, n)


@pytest.mark.parametrize("target", TARGETS)
def test_target_plans_differ_from_the_source(target: str, chain: dict[str, Any]) -> None:
    """Each target really is another plan: TorchRec's planner uses only its own sharding types (no embark_*), keeps
    the DP table data-parallel, and lays out the grid tables otherwise; the 2-rank EMBark plan runs our grid and
    unique shardings too."""
    shardings = chain["targets"][target][0]["shardings"]
    assert shardings["dp"] == "data_parallel"
    if target.startswith("torchrec"):
        assert not any(s.startswith("embark") for s in shardings.values()), shardings
    elif target == "embark@2":
        assert shardings == {
            "grid": "embark_rb",
            "hier": "embark_rb_hier",
            "ub": "embark_ub",
            "dp": "data_parallel",
            "tw": "column_wise",
        }


def test_training_resumes_from_the_loaded_state(chain: dict[str, Any]) -> None:
    """The 2-rank model that loaded the 4-rank checkpoint trains on exactly as an unsharded model started from the
    saved weights and Adagrad sums: after two more steps, every weight and optimizer state within 1e-5 (relative to
    the tensor's magnitude for the sums), the dense step count exact; and the steps did move every tensor, so the
    loaded optimizer state was used, not just stored."""
    resumed = chain["second"][0]["resumed"]
    assert len(resumed) == 2 * len(TABLES) + 1
    for path, (diff, scale, moved) in resumed.items():
        if path.endswith("/step"):
            assert diff == 0.0 and scale == FIRST_STEPS + MORE_STEPS, (path, diff, scale)
            continue
        assert diff <= 1e-5 * max(1.0, scale), (path, diff, scale)
        assert moved > 1e-3, (path, moved)
