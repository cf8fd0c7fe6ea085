"""Determinism: EmbarkPlanner.collective_plan gives byte-identical plans on every rank and in every run, and training
a sharded model with a fixed seed is bitwise reproducible run to run on CPU.

Two spawns of 4 gloo ranks (2 nodes x 2) each plan the same model with collective_plan and then train it for three
steps (fused and dense Adagrad, Zipf IDs) under the plan they got; a third run, a fresh interpreter with another
string-hash seed, plans it on 4 threaded ranks. The model has twin tables (equal cost, so tie-breaking matters) and
the planner's memory cap is small and `big` may only be a grid, so the plan holds a grid, unique-based row splits,
a data-parallel table and a table-wise one. (tests/plan/test_planner.py checks plans per threaded rank as dicts,
and tests/plan/test_plan_search.py checks plan_model across hash seeds; here it is the text of the torchrec
ShardingPlan and the plan file that DMP and users see, over real processes, plus training.)
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.planner.torchrec_plans import from_sharding_plan
from embark_torchrec.plan.layout.constraints import TableConstraints
from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.planner.planner import EmbarkPlanner
from embark_torchrec.plan.model.spec import IdDistribution
from embark_torchrec.plan.model.topology import PRESETS, Hardware, Topology
from embark_torchrec.testing import run_ranks
from tests.support.checkpoints import (
    dense_optimizer,
    gather_full,
    make_sharder,
    shard,
    train_steps,
    training_state,
)
from embark_torchrec.testing.training import SparseArch

WORLD, LOCAL = 4, 2
STEPS = 3
SEED = 1234
# name, rows, dim, features
TABLES_SPEC = [
    ("big", 480, 32, ["big_a", "big_b"]),
    ("wide", 300, 32, ["wide_f"]),
    ("twin_a", 200, 16, ["twin_a_f"]),
    ("twin_b", 200, 16, ["twin_b_f"]),
    ("hot", 400, 8, ["hot_f"]),
    ("tiny", 8, 4, ["tiny_f"]),
    ("small", 64, 8, ["small_f"]),
    ("tw", 50, 12, ["tw_f"]),
]
TABLES = [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f) for n, r, d, f in TABLES_SPEC]
_BYTES = sum(r * (d * 4 + 4) for _, r, d, _ in TABLES_SPEC)  # weights + row-wise optimizer state, as the planner counts
HARDWARE = Hardware(  # a network slower than the node's links, GPU-like free per-ID and per-collective overheads
    name="test",
    hbm_gb=PRESETS["cpu-gloo"].hbm_reserve_gb + 1.6 * _BYTES / WORLD / 1e9,
    hbm_reserve_gb=PRESETS["cpu-gloo"].hbm_reserve_gb,
    hbm_bw_gbps=5.0,
    intra_node_bw_gbps=2.0,
    inter_node_bw_gbps=1.0,
    dense_ms_per_ksample=50.0,
)
CONSTRAINTS: dict[str, Any] = {
    "hot": ParameterConstraints(pooling_factors=[8.0]),
    "big": ParameterConstraints(pooling_factors=[8.0, 2.0], sharding_types=["grid_shard"]),  # a grid, always
    "tw": TableConstraints(layout=TableLayout.table_wise(50, 12, 3)),
}


def _planner() -> EmbarkPlanner:
    """World size from the process group, nodes from LOCAL_WORLD_SIZE."""
    return EmbarkPlanner(
        batch_size=32,
        hardware=HARDWARE,
        compute_device="cpu",
        constraints=CONSTRAINTS,
        id_distribution=IdDistribution("zipf", 1.1),
    )


def _plan_texts() -> tuple[Any, dict[str, Any]]:
    """collective_plan on this rank: the ShardingPlan, and its texts (str, JSON of torchrec's serialisation, the
    plan file read back from it, and on the planning rank the plan file the planner kept)."""
    planner = _planner()
    sharding_plan = planner.collective_plan(SparseArch(TABLES, False, torch.device("meta")), [make_sharder()])
    topology = Topology(dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"]))
    texts = {
        "rank": dist.get_rank(),
        "str": str(sharding_plan),
        "serialized": json.dumps(sharding_plan._serialize(), sort_keys=True),
        "plan_file": json.dumps(
            from_sharding_plan(sharding_plan, topology, module_path="ebc").to_dict(), sort_keys=True
        ),
        "planner_plan_file": json.dumps(planner.plans["ebc"].plan.to_dict(), sort_keys=True)
        if "ebc" in planner.plans
        else None,
    }
    return sharding_plan, texts


def plan_only() -> dict[str, Any]:
    """For the threaded run in another interpreter."""
    return _plan_texts()[1]


def _plan_and_train() -> dict[str, Any]:
    sharding_plan, texts = _plan_texts()
    torch.manual_seed(SEED)
    model = shard(TABLES, sharding_plan)
    dense = dense_optimizer(model)
    losses = train_steps(model, dense, TABLES, STEPS, seed=SEED, batch_per_rank=8, ids="zipf")
    full = gather_full(training_state(model, dense))
    shardings = sorted({ps.sharding_type for ps in sharding_plan.plan["ebc"].values()})
    return {
        **texts,
        "losses": [struct.pack("<f", x) for x in losses],
        "full": full if dist.get_rank() == 0 else None,
        "shardings": shardings,
    }


_SUBPROCESS = """
import json, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from embark_torchrec.testing import threaded_ranks
from test_determinism import plan_only
print("RESULT " + json.dumps(threaded_ranks(plan_only, {world}, {local}, timeout_s=300)))
"""


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """Three runs: a fresh interpreter with another hash seed (started first, runs alongside) and two spawns."""
    tests = Path(__file__).resolve().parent
    seed = os.environ.get("PYTHONHASHSEED")
    other_seed = "12345" if seed in (None, "", "random") else str((int(seed) + 1) % 4294967296)
    code = _SUBPROCESS.format(root=str(tests.parents[1]), tests=str(tests), world=WORLD, local=LOCAL)
    env = {**os.environ, "PYTHONHASHSEED": other_seed}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first = run_ranks(_plan_and_train, WORLD, local_world_size=LOCAL, timeout_s=300)
        second = run_ranks(_plan_and_train, WORLD, local_world_size=LOCAL, timeout_s=300)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-3000:]
    return {"first": first, "second": second, "other_interpreter": json.loads(lines[0][len("RESULT ") :])}


TEXTS = ("str", "serialized", "plan_file")


def test_collective_plan_is_byte_identical_on_every_rank(runs: dict[str, Any]) -> None:
    """Within one run of 4 gloo processes, every rank's ShardingPlan has the same text byte for byte (its str,
    the JSON of torchrec's serialisation with every shard's offsets, sizes and placement, and the plan file read
    back from it), and that plan file is exactly the one the planning rank kept (planner.plans)."""
    for name in ("first", "second"):
        results = runs[name]
        assert [r["rank"] for r in results] == list(range(WORLD))
        for key in TEXTS:
            assert len({r[key] for r in results}) == 1, (name, key, [r[key] for r in results])
        assert results[0]["planner_plan_file"] == results[0]["plan_file"]  # rank 0 planned
        assert all(r["planner_plan_file"] in (None, r["plan_file"]) for r in results)


def test_collective_plan_is_byte_identical_across_runs(runs: dict[str, Any]) -> None:
    """Two spawns and a fresh interpreter with another string-hash seed (on threaded ranks) produce the same plan
    texts byte for byte, on every rank."""
    reference = runs["first"][0]
    for name in ("second", "other_interpreter"):
        for rank, result in enumerate(runs[name]):
            for key in TEXTS:
                assert result[key] == reference[key], (name, rank, key)
    assert runs["other_interpreter"][0]["planner_plan_file"] == reference["planner_plan_file"]


def test_the_plan_covers_grid_ub_dp_and_table_wise(runs: dict[str, Any]) -> None:
    """The determinism checks are over a plan with every kind of layout: a grid of rows x columns (several cells),
    unique-based and data-parallel tables, and a table-wise one (else the tests above would say little)."""
    plan = json.loads(runs["first"][0]["planner_plan_file"])["tables"]
    clusters = {entry["cluster"] for entry in plan.values()}
    assert clusters == {"rb", "ub", "dp"}, clusters
    grid = [
        name
        for name, entry in plan.items()
        if len({tuple(s["rows"]) for s in entry["shards"]}) > 1 and len({tuple(s["cols"]) for s in entry["shards"]}) > 1
    ]
    assert grid, plan
    shardings = set(runs["first"][0]["shardings"])
    assert {"embark_ub", "data_parallel", "table_wise"} <= shardings and shardings & {"embark_rb", "embark_rb_hier"}


def test_training_with_a_fixed_seed_is_bitwise_reproducible(runs: dict[str, Any]) -> None:
    """Two runs (separate processes) of the same sharded model, seed, plan and batches give bitwise-equal losses
    on every rank at every step, and bitwise-equal weights and optimizer states (fused momentum of every
    model-parallel table, dense Adagrad sum and step of the DP table) after three steps; training moved them."""
    first, second = runs["first"], runs["second"]
    for rank in range(WORLD):
        assert len(first[rank]["losses"]) == STEPS
        assert first[rank]["losses"] == second[rank]["losses"], rank
    a, b = first[0]["full"], second[0]["full"]
    names = {t.name for t in TABLES}
    assert {k.split(".")[2] for k in a if k.startswith("model/")} == names
    assert {k.split(".")[2] for k in a if k.startswith(("fused/", "dense/"))} == names
    assert set(a) == set(b)
    for key in sorted(a):
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        same = a[key].contiguous().view(torch.int32) if a[key].dtype == torch.float32 else a[key]
        other = b[key].contiguous().view(torch.int32) if b[key].dtype == torch.float32 else b[key]
        assert torch.equal(same, other), (key, float((a[key].double() - b[key].double()).abs().max()))
        if "momentum1" in key or key.endswith("/sum"):
            assert bool((a[key] > 0).any()), key  # every table was trained: non-zero Adagrad state
    assert len({loss for r in first for loss in r["losses"]}) > 1
