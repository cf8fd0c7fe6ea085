"""Randomised: over random model specs and topologies, the plans EmbarkPlanner's search makes run exactly.

Each case draws (seeded) 3-6 tables of 8-500 rows and dims 4-32 (multiples of 4), 1-2 features each, uniform or
Zipf IDs for the planner, for a world of 2 ranks (2 nodes x 1), 3 (1 node) or 4 (2 nodes x 2); plan_model plans it
on the "cpu-gloo" hardware with a memory cap of 1.15-2.5x the tables' share per rank, so the search splits tables
into row, column
and grid cells and puts tables in the DP and UB clusters. Then, in gloo ranks, a model with those tables (sum or
mean pooling per table), sharded by that plan, trains 1 or 2 steps (fused SGD or Adagrad; uniform or Zipf IDs)
next to an unsharded copy: outputs and weights must match. The cases are grouped into one spawn per world size.

The seeds are fixed (SALT), so the test is deterministic; SALT was picked so that the cases cover grids (RB and UB),
a split table at every world size, a hierarchical row split, DP, UB and torchrec's own column- and table-wise types,
which test_random_cases_cover_every_kind checks: if a change to the planner loses that coverage, pick another SALT.
(TorchRec's row-wise type sends int64 IDs where our grid sends int32 ones, so the planner now reduces row splits
hierarchically on our sharding instead; test_sharding_grid.py trains torchrec's row-wise layouts.)

A wider sweep (45-60 cases per world size, outside the suite) found one bug: when the planner gave a rank several
cells of one table with different column widths, DMP construction failed (torchrec's per-table parameter views
assume equal cell shapes). Plans now never do that (validation refuses it, the search avoids it); the tests at the
end check both, and an xfail pins down the remaining torchrec limit (named_parameters with mixed row counts).
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from embark_torchrec.plan.layout.tables import PlanError, TableLayout
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import PRESETS, Hardware, Topology
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import compare_sharded_training, sharded_model

SALT = 120
CASES = {2: 4, 3: 3, 4: 4}  # world size -> cases
LOCAL = {2: 1, 3: 3, 4: 2}  # world size -> local world size: 2 nodes x 1, 1 node x 3, 2 nodes x 2
ATOL = 1e-5
CAP_FACTORS = (1.15, 1.3, 1.6, 2.5)  # memory per rank / (the tables' bytes / world size)


def _spec_and_topology(ws: int, index: int, salt: int) -> tuple[ModelSpec, Topology]:
    rng = np.random.default_rng([ws, index, salt])
    lws = LOCAL[ws]  # one spawn per world size, and the ranks' LOCAL_WORLD_SIZE must be the plan's
    tables = []
    for i in range(int(rng.integers(3, 7))):
        tables.append(
            TableSpec(
                name=f"t{i}",
                rows=int(rng.integers(8, 501)),
                dim=int(4 * rng.integers(1, 9)),
                pooling=float(rng.choice([1.0, 2.0, 4.0, 8.0])),
                feature_names=tuple(f"t{i}_f{j}" for j in range(int(rng.integers(1, 3)))),
                id_distribution=IdDistribution("zipf", 1.1) if rng.random() < 0.5 else None,
            )
        )
    spec = ModelSpec(f"random_w{ws}_{index}", ws * 64, tuple(tables))
    need = sum(t.rows * (t.dim * 4 + 4) for t in tables)  # weights + row-wise optimizer state, as the planner counts
    cap = float(rng.choice(CAP_FACTORS)) * need / ws
    # a network slower than the node's links and GPU-like free per-ID and per-collective overheads, so that
    # unique-based tables, hierarchical reductions and mixed groups appear among the kinds checked
    reserve = PRESETS["cpu-gloo"].hbm_reserve_gb
    hardware = Hardware(
        name="test",
        hbm_gb=reserve + cap / 1e9,
        hbm_reserve_gb=reserve,
        hbm_bw_gbps=5.0,
        intra_node_bw_gbps=2.0,
        inter_node_bw_gbps=1.0,
        dense_ms_per_ksample=50.0,
    )
    return spec, Topology(ws, lws, hardware)


@cache
def random_case(ws: int, index: int, salt: int = SALT) -> dict[str, Any]:
    """One case: the tables, the plan's layouts, and how to train (all from the seeds)."""
    spec, topology = _spec_and_topology(ws, index, salt)
    planned = plan_model(spec, topology)
    rng = np.random.default_rng([ws, index, salt, 1])
    tables = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            feature_names=list(t.feature_names),
            pooling=PoolingType.MEAN if rng.random() < 0.5 else PoolingType.SUM,
        )
        for t in spec.tables
    ]
    return {
        "tables": tables,
        "layouts": {t.name: planned.plan[t.name] for t in spec.tables},
        "local_world_size": topology.local_world_size,
        "steps": int(rng.integers(1, 3)),
        "optimizer": str(rng.choice(["sgd", "adagrad"])),
        "ids": str(rng.choice(["uniform", "zipf"])),
        "batch_per_rank": int(rng.integers(2, 9)),
        "seed": int(rng.integers(0, 10_000)),
    }


def _kind(layout: TableLayout, rows: int, ws: int, lws: int) -> str:
    """How a layout runs, e.g. "dp", "rb grid embark", "ub rows embark", "rb rows hier embark",
    "rb cols column_wise"."""
    if layout.cluster == "dp":
        return "dp"
    nr, nc = layout.num_row_slices, layout.num_col_slices
    shape = "grid" if nr > 1 and nc > 1 else "rows" if nr > 1 else "cols" if nc > 1 else "whole"
    hier = " hier" if layout.hierarchical and nr > 1 else ""
    return f"{layout.cluster} {shape}{hier} {layout.kind.builtin_sharding_type(layout, rows, ws, lws) or 'embark'}"


def _coverage() -> Counter[str]:
    kinds: Counter[str] = Counter()
    for ws, n in CASES.items():
        for index in range(n):
            case = random_case(ws, index)
            for t in case["tables"]:
                kinds[_kind(case["layouts"][t.name], t.num_embeddings, ws, case["local_world_size"])] += 1
    return kinds


def _run_world(cases: list[dict[str, Any]]) -> list[dict[str, float]]:
    assert dist.get_world_size() in CASES
    return [
        compare_sharded_training(
            c["tables"],
            c["layouts"],
            c["local_world_size"],
            steps=c["steps"],
            optimizer=c["optimizer"],
            batch_per_rank=c["batch_per_rank"],
            seed=c["seed"],
            ids=c["ids"],
        )
        for c in cases
    ]


def test_random_cases_cover_every_kind() -> None:
    """The random cases' plans include RB and UB grids (row x column cells), a hierarchical row split run by our
    grid sharding, unique-based and data-parallel tables, and torchrec's column- and table-wise types; and
    a split table at every world size. Printed: how many tables of each kind."""
    kinds = _coverage()
    print("random plan coverage:", dict(sorted(kinds.items())))
    present = set(kinds)
    wanted = {
        "dp": "dp",
        "rb grid": "rb grid ",
        "ub grid": "ub grid ",
        "ub": "ub ",
        "hierarchical embark": " hier embark",
        "column_wise": " column_wise",
        "table_wise": " table_wise",
    }
    missing = [name for name, part in wanted.items() if not any(part in k or k == part for k in present)]
    assert not missing, (missing, dict(kinds))
    for ws, n in CASES.items():
        layouts = [layout for i in range(n) for layout in random_case(ws, i)["layouts"].values()]
        assert any(
            layout.cluster != "dp" and layout.num_row_slices * layout.num_col_slices > 1 for layout in layouts
        ), ws


@pytest.mark.parametrize("ws", sorted(CASES))
def test_one_sharded_step_equals_unsharded(ws: int) -> None:
    """For every random case at this world size, the sharded model's pooled output of every feature at every step
    and every table's weights after the last step equal the unsharded model's within 1e-5."""
    cases = [random_case(ws, i) for i in range(CASES[ws])]
    results = run_ranks(_run_world, ws, local_world_size=LOCAL[ws], timeout_s=400, args=(cases,))
    for index, case in enumerate(cases):
        features = {f for t in case["tables"] for f in t.feature_names}
        expected = {f"step{s}/{f}" for s in range(case["steps"]) for f in features} | {
            f"weight/ebc.embedding_bags.{t.name}.weight" for t in case["tables"]
        }
        for rank, per_case in enumerate(results):
            diffs = per_case[index]
            assert set(diffs) == expected, (ws, index, rank, sorted(set(diffs) ^ expected))
            bad = {k: v for k, v in diffs.items() if not v <= ATOL}
            assert not bad, (ws, index, rank, case["layouts"], bad)


# ---------------------------------------------------------------- cells of one table of different shapes on a rank

_MIXED_ROWS_LIMIT = (
    "torchrec 1.8's _gen_named_parameters_by_table_fused (batched_embedding_kernel.py) views a table's cells in one "
    "TBE as count x rows x dim of the first cell; when one rank holds cells of a table with different rows, the "
    "table's named parameter covers the wrong elements (training, state_dict and checkpoints are exact). With "
    "different widths DMP construction fails, so plans never give a rank cells of one table of different widths."
)
MIXED_WIDTHS = TableLayout("rb", (0, 5, 10), (0, 8, 12), ((0, 1), (0, 0)))  # rank 0: 5x8, 5x8 and 5x4
MIXED_ROWS = TableLayout("rb", (0, 7, 20, 33), (0, 8, 16), ((0, 0), (1, 0), (0, 1)))  # rank 0: 7x8, 7x8, 13x8, 13x8
PLANNER_MIXED = (3, 2, 12)  # (world size, index, salt) of a random case whose plan once gave a rank mixed widths


def _mixed_widths(case: dict[str, Any]) -> list[tuple[str, int]]:
    """(table, rank) pairs where the rank holds cells of the table with different column widths."""
    found = []
    for name, layout in case["layouts"].items():
        if layout.cluster == "dp":
            continue
        widths: dict[int, set[int]] = {}
        for s in layout.shards():
            widths.setdefault(s.rank, set()).add(s.cols[1] - s.cols[0])
        found += [(name, rank) for rank, w in widths.items() if len(w) > 1]
    return found


def _named_weight_and_cells(rows: int, dim: int, layout: TableLayout) -> tuple[int, int]:
    """(elements of the table's named parameter, elements of the cells this rank holds)."""
    tables = [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=dim, feature_names=["f"])]
    model = sharded_model(tables, {"t": layout}, dist.get_world_size())
    named = sum(p.numel() for n, p in model.named_parameters() if n == "ebc.embedding_bags.t.weight")
    held = sum(s.tensor.numel() for s in model.state_dict()["ebc.embedding_bags.t.weight"].local_shards())
    return named, held


def test_a_rank_with_cells_of_different_widths_is_refused() -> None:
    """A layout giving one rank cells of one table with widths 8 and 4 is refused by name (table and rank), before
    TorchRec would fail building it."""
    with pytest.raises(PlanError, match=r"table 't': rank 0 holds cells of different widths"):
        MIXED_WIDTHS.validate("t", 10, 12, 2)


def test_planner_never_gives_a_rank_cells_of_different_widths() -> None:
    """The random case whose plan once gave a rank cells of widths 12, 12 and 8 is now planned without mixed widths,
    and one sharded step equals the unsharded one."""
    ws, index, salt = PLANNER_MIXED
    case = random_case(ws, index, salt)
    assert not _mixed_widths(case), _mixed_widths(case)
    results = run_ranks(_run_world, ws, local_world_size=LOCAL[ws], timeout_s=120, args=([case],))
    for per_case in results:
        assert max(per_case[0].values()) <= ATOL, per_case


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=_MIXED_ROWS_LIMIT)
def test_named_parameter_of_a_table_covers_its_cells() -> None:
    """A rank holding four cells of one table with equal widths but 7 and 13 rows: the table's parameter in
    model.named_parameters() has as many elements as the rank's cells of the table (as with one cell per rank)."""
    results = run_ranks(_named_weight_and_cells, 2, local_world_size=2, timeout_s=120, args=(33, 16, MIXED_ROWS))
    for rank, (named, held) in enumerate(results):
        assert named == held, (rank, named, held)
