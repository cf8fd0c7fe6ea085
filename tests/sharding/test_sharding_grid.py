"""GridPooledEmbeddingSharding and the built-in types, run through EmbarkEmbeddingBagCollectionSharder in
DistributedModelParallel, train exactly like an unsharded EmbeddingBagCollection; the sharded state_dict holds the
plan's cells; and a distributed checkpoint moves weights between models sharded by different plans.

One spawn per world size (2, 3, and 4 as 2 nodes x 2). In each, one model holds a table for every layout kind, so a
single compare_sharded_training call covers all of them; six calls per world size cover every pair of
{sum pooling, mean pooling, weighted features} x {fused SGD, fused Adagrad} x {every rank sends IDs, one rank silent}.
Every batch has empty bags. The 4-rank spawn also runs the checkpoint round trip.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.sharding.grid import BlockGather, ColumnFold, GridPooledEmbeddingSharding
from embark_torchrec.sharding.unique import UniquePooledEmbeddingSharding
from embark_torchrec.sharding.sharded_ebc import EmbarkShardedEmbeddingBagCollection
from embark_torchrec.testing import copy_global_weights, global_kjt_batch, run_ranks
from embark_torchrec.testing.training import SparseArch, compare_sharded_training, sharded_model
from tests.support import toy

pytestmark = pytest.mark.torchrec_version

ATOL = 1e-5
STEPS = 2
WORLDS = {2: 2, 3: 3, 4: 2}  # world size -> local world size (4 ranks as 2 nodes x 2)
SILENT = {2: 1, 3: 2, 4: 1}
# (pooling, optimizer, silent?) covering every pair of the three factors
CONFIGS = [
    ("sum", "sgd", False),
    ("sum", "adagrad", True),
    ("mean", "sgd", True),
    ("mean", "adagrad", False),
    ("weighted", "sgd", True),
    ("weighted", "adagrad", False),
]


# name -> (rows, dim, number of features, expected sharding type, {world size: layout})
TABLES: dict[str, tuple[int, int, int, str, dict[int, TableLayout]]] = {
    "tw": (20, 12, 1, "table_wise", {ws: TableLayout.table_wise(20, 12, ws - 1) for ws in WORLDS}),
    "cw": (
        18,
        16,
        1,
        "column_wise",
        {
            2: TableLayout("rb", (0, 18), (0, 4, 16), ((1, 0),)),
            3: TableLayout("rb", (0, 18), (0, 4, 8, 16), ((2, 0, 1),)),
            4: TableLayout("rb", (0, 18), (0, 8, 12, 16), ((3, 1, 1),)),  # uneven widths, a rank twice
        },
    ),
    "rw": (
        31,
        8,
        1,
        "row_wise",
        {ws: toy.row_wise(31, 8, ws) for ws in WORLDS},
    ),
    "twrw": (
        25,
        8,
        1,
        "table_row_wise",
        {4: TableLayout("rb", toy.ceil_rows(25, 2), (0, 8), ((2,), (3,)), hierarchical=True)},
    ),
    # a 2x2 grid with uneven rows, shared by two features
    "grid": (40, 16, 2, "embark_rb", {ws: toy.grid(ws) for ws in WORLDS}),
    "grid_hier": (36, 8, 1, "embark_rb_hier", {ws: toy.hierarchical_grid(ws) for ws in WORLDS}),
    # uneven row slices (3 / 17 / 17 rows); at 4 ranks on {0, 2, 3}
    "uneven": (
        37,
        8,
        1,
        "embark_rb",
        {
            2: TableLayout("rb", (0, 3, 37), (0, 8), ((1,), (0,))),
            3: TableLayout("rb", (0, 3, 20, 37), (0, 8), ((2,), (0,), (1,))),
            4: TableLayout("rb", (0, 3, 20, 37), (0, 8), ((0,), (2,), (3,))),
        },
    ),
    # a row split across ranks of different nodes (at 2 and 3 ranks, one node: ranks out of order)
    "xnode": (
        30,
        12,
        1,
        "embark_rb",
        {
            2: TableLayout("rb", (0, 11, 30), (0, 12), ((1,), (0,))),
            3: TableLayout("rb", (0, 11, 30), (0, 12), ((2,), (1,))),
            4: TableLayout("rb", (0, 11, 30), (0, 12), ((1,), (2,))),
        },
    ),
    "xnode_hier": (
        30,
        12,
        1,
        "embark_rb_hier",
        {
            2: TableLayout("rb", (0, 11, 30), (0, 12), ((1,), (0,)), hierarchical=True),
            3: TableLayout("rb", (0, 11, 30), (0, 12), ((0,), (2,)), hierarchical=True),
            4: TableLayout("rb", (0, 11, 30), (0, 12), ((0,), (3,)), hierarchical=True),
        },
    ),
    # several cells of one table on one rank (rank 0: four of six, in non-adjacent row slices)
    "multi": (
        33,
        16,
        1,
        "embark_rb",
        {ws: TableLayout("rb", (0, 7, 20, 33), (0, 8, 16), ((0, 0), (ws - 1, 0), (0, 1))) for ws in WORLDS},
    ),
    "ub": (24, 8, 1, "embark_ub", {4: toy.unique(4)}),
    "dp": (10, 4, 1, "data_parallel", {ws: TableLayout.data_parallel() for ws in WORLDS}),
}
# in the mean configuration, a SUM table in the same grid sharding as MEAN ones
MIXED_SUM = ("grid_sum", 26, 8, {ws: TableLayout("rb", (0, 9, 26), (0, 8), ((ws - 1,), (0,))) for ws in WORLDS})


def _names(ws: int) -> list[str]:
    return [name for name, spec in TABLES.items() if ws in spec[4]]


# torchrec's RW/TWRW MEAN fix-up divides every other feature of the collection by its bag length (see
# test_row_wise_mean_beside_other_tables), so in the "mean" configuration the RW and TWRW tables pool by SUM, and
# their MEAN pooling is checked in a collection of their own (_row_split_mean).
_TORCHREC_ROW_SPLIT = ("row_wise", "table_row_wise")


def _tables(ws: int, pooling: str) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    """Every layout kind the world size allows, all with the given pooling ("weighted" = SUM, weighted features;
    "mean" = MEAN except torchrec's row splits, plus one SUM table in the same grid sharding as MEAN ones)."""
    configs, layouts = [], {}
    for name in _names(ws):
        rows, dim, n_features, kind, per_world = TABLES[name]
        mean = pooling == "mean" and kind not in _TORCHREC_ROW_SPLIT
        features = [f"{name}_f{i}" for i in range(n_features)]
        configs.append(
            EmbeddingBagConfig(
                name=name,
                num_embeddings=rows,
                embedding_dim=dim,
                feature_names=features,
                pooling=PoolingType.MEAN if mean else PoolingType.SUM,
            )
        )
        layouts[name] = per_world[ws]
    if pooling == "mean":
        name, rows, dim, per_world = MIXED_SUM
        configs.append(
            EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=[f"{name}_f0"])
        )
        layouts[name] = per_world[ws]
    return configs, layouts


def _row_split_mean(ws: int) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    """torchrec's RW (and at 4 ranks TWRW) tables pooling by MEAN, alone in their collection."""
    configs, layouts = [], {}
    for name in ("rw", "twrw"):
        rows, dim, _, _, per_world = TABLES[name]
        if ws in per_world:
            configs.append(
                EmbeddingBagConfig(
                    name=name,
                    num_embeddings=rows,
                    embedding_dim=dim,
                    feature_names=[f"{name}_f0"],
                    pooling=PoolingType.MEAN,
                )
            )
            layouts[name] = per_world[ws]
    return configs, layouts


def _row_split_mean_beside_others(ws: int) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    """A MEAN table on torchrec's row-wise sharding next to a table-wise SUM table and a grid SUM table."""
    rows, dim, _, _, per_world = TABLES["rw"]
    configs = [
        EmbeddingBagConfig(
            name="rw", num_embeddings=rows, embedding_dim=dim, feature_names=["rw_f0"], pooling=PoolingType.MEAN
        ),
        EmbeddingBagConfig(name="tw", num_embeddings=20, embedding_dim=12, feature_names=["tw_f0"]),
        EmbeddingBagConfig(name="grid", num_embeddings=40, embedding_dim=16, feature_names=["grid_f0"]),
    ]
    return configs, {"rw": per_world[ws], "tw": TABLES["tw"][4][ws], "grid": TABLES["grid"][4][ws]}


def _expected_cells(layout: TableLayout, rank: int) -> list[tuple[list[int], list[int]]]:
    return sorted(
        ([s.rows[0], s.cols[0]], [s.rows[1] - s.rows[0], s.cols[1] - s.cols[0]])
        for s in layout.shards()
        if s.rank == rank
    )


# ---------------------------------------------------------------- in each rank (module level: must pickle)


def _sharded_ebc(model: nn.Module) -> EmbarkShardedEmbeddingBagCollection:
    found = [m for m in model.modules() if isinstance(m, EmbarkShardedEmbeddingBagCollection)]
    assert len(found) == 1
    return found[0]


def _inspect(model: nn.Module) -> dict[str, Any]:
    """The sharding classes DMP built, and what the state_dict holds: ShardedTensor (global size, local shards) or
    a plain tensor (its shape)."""
    sebc = _sharded_ebc(model)
    shardings = {t: type(s).__name__ for t, s in zip(sebc._sharding_types, sebc._embedding_shardings)}
    state: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            shards = sorted(
                (list(s.metadata.shard_offsets), list(s.metadata.shard_sizes)) for s in value.local_shards()
            )
            sizes_ok = all(list(s.tensor.shape) == list(s.metadata.shard_sizes) for s in value.local_shards())
            state[key] = ("sharded", list(value.size()), shards, sizes_ok)
        else:
            state[key] = ("tensor", list(value.shape))
    return {"shardings": shardings, "state": state}


def _max_weight_diff(model: nn.Module, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |weight - reference| per state_dict key, over this rank's local shards (plain tensors: whole)."""
    out: dict[str, float] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            worst = 0.0
            for shard in value.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                worst = max(worst, float((shard.tensor - reference[key][r0 : r0 + nr, c0 : c0 + nc]).abs().max()))
            out[key] = worst
        else:
            out[key] = float((value - reference[key]).abs().max())
    return out


def _target_plans(tables: list[EmbeddingBagConfig], ws: int) -> dict[str, dict[str, TableLayout]]:
    """Plans to load a checkpoint into, each unlike the grid plan it was saved from; rows cut at a third.

    table_wise: every table whole, on another rank than its first cell before. other_grid: column halves where the
    width allows (equal widths), every cell on a different rank, hierarchical on every other table. uneven_cols: the
    same with columns cut at 4 (unequal widths). multi_cell: equal halves, but one rank holds three cells of a table.
    """
    plans: dict[str, dict[str, TableLayout]] = {"table_wise": {}, "other_grid": {}, "uneven_cols": {}, "multi_cell": {}}
    for i, t in enumerate(tables):
        rows, dim = t.num_embeddings, t.embedding_dim
        plans["table_wise"][t.name] = TableLayout.table_wise(rows, dim, (i + 1) % ws)
        row_bounds = (0, rows // 3, rows)
        halves = (0, dim // 2, dim) if dim % 8 == 0 else (0, dim)
        at_four = (0, 4, dim) if dim > 8 else (0, dim)
        for name, cols in (("other_grid", halves), ("uneven_cols", at_four)):
            n_c = len(cols) - 1
            distinct = tuple(tuple((i + r * n_c + c) % ws for c in range(n_c)) for r in range(2))
            plans[name][t.name] = TableLayout("rb", row_bounds, cols, distinct, hierarchical=i % 2 == 0)
        k = i % ws
        crowded = ((k, k), ((k + 1) % ws, k)) if len(halves) == 3 else ((k,), ((k + 1) % ws,))
        plans["multi_cell"][t.name] = TableLayout("rb", row_bounds, halves, crowded)
    return plans


def _checkpoint_round_trip(directory: str, lws: int) -> dict[str, Any]:
    """Save a model sharded by the grid plan with torch.distributed.checkpoint; load it in place into a fresh model
    sharded by another plan, save that, load into the next (grid -> table_wise -> other_grid -> uneven_cols ->
    multi_cell). Reports per target: weight differences to the saved weights before and after loading, output
    differences, the shards held, and whether DMP.load_state_dict copies the loaded state into yet another fresh model
    exactly."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    tables, grid_plan = _tables(ws, "sum")
    torch.manual_seed(1)
    reference = SparseArch(tables, False, torch.device("cpu"))
    ref_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    source = sharded_model(tables, grid_plan, lws)
    copy_global_weights(source, reference)
    dcp.save(source.state_dict(), checkpoint_id=f"{directory}/grid")

    plans = _target_plans(tables, ws)
    results: dict[str, Any] = {"plans": plans}
    batch = global_kjt_batch(tables, ws, 4, seed=99)[rank]
    with torch.no_grad():
        expected_out = reference(batch).to_dict()
    previous = "grid"
    for step, (name, plan) in enumerate(plans.items()):
        torch.manual_seed(100 + step)  # fresh, different weights before loading
        target = sharded_model(tables, plan, lws)
        before = _max_weight_diff(target, ref_state)
        dcp.load(target.state_dict(), checkpoint_id=f"{directory}/{previous}")  # in place, into the live weights
        with torch.no_grad():
            out = target(batch)
            out = (out.wait() if hasattr(out, "wait") else out).to_dict()
        results[name] = {
            "before": before,
            "after": _max_weight_diff(target, ref_state),
            "output": {k: float((out[k] - v).abs().max()) for k, v in expected_out.items() if k in out},
            "inspect": _inspect(target),
        }
        dcp.save(target.state_dict(), checkpoint_id=f"{directory}/{name}")
        previous = name
        # the other loading path: a plain state_dict -> load_state_dict between models of the same plan
        copy = sharded_model(tables, plan, lws)
        try:
            copy.load_state_dict(target.state_dict())
            results[name]["load_state_dict"] = _max_weight_diff(copy, ref_state)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
            results[name]["load_state_dict"] = f"{type(exc).__name__}: {exc}"
    return results


def _run_world(lws: int, checkpoint_dir: str | None) -> dict[str, Any]:
    ws = dist.get_world_size()
    out: dict[str, Any] = {"training": {}}
    for pooling, optimizer, silent in CONFIGS:
        tables, layouts = _tables(ws, pooling)
        out["training"][(pooling, optimizer, silent)] = compare_sharded_training(
            tables,
            layouts,
            lws,
            steps=STEPS,
            optimizer=optimizer,
            weighted=pooling == "weighted",
            silent_rank=SILENT[ws] if silent else None,
            seed=ws,
        )
    for key, make in (
        ("row_split_mean", _row_split_mean),
        ("row_split_mean_beside_others", _row_split_mean_beside_others),
    ):
        tables, layouts = make(ws)
        out[key] = compare_sharded_training(
            tables, layouts, lws, steps=STEPS, optimizer="adagrad", silent_rank=SILENT[ws], seed=ws + 10
        )
    tables, layouts = _tables(ws, "mean")
    out["inspect"] = _inspect(sharded_model(tables, layouts, lws))
    if checkpoint_dir is not None:
        out["checkpoint"] = _checkpoint_round_trip(checkpoint_dir, lws)
    return out


# ---------------------------------------------------------------- the spawns, one per world size


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """runs(ws): the per-rank results of the spawn for world size ws, started on first use."""
    cache: dict[int, Any] = {}

    def get(ws: int) -> list[dict[str, Any]]:
        if ws not in cache:  # a failed spawn is kept too, so that it is not repeated for every test
            checkpoint = str(tmp_path_factory.mktemp(f"dcp{ws}")) if ws == 4 else None
            try:
                cache[ws] = run_ranks(
                    _run_world, ws, local_world_size=WORLDS[ws], timeout_s=400, args=(WORLDS[ws], checkpoint)
                )
            except Exception as exc:  # noqa: BLE001
                cache[ws] = exc
        if isinstance(cache[ws], Exception):
            raise cache[ws]
        return cache[ws]

    return get


def _assert_all_close(results: list[dict[str, Any]], key: str, tables: list[EmbeddingBagConfig]) -> None:
    toy.assert_trained_like_unsharded([result[key] for result in results], tables, STEPS, ATOL, key)


@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(map(str, c)) for c in CONFIGS])
@pytest.mark.parametrize("ws", sorted(WORLDS))
def test_sharded_training_equals_unsharded(ws: int, config: tuple[str, str, bool], runs: Any) -> None:
    """For every layout kind at once (TW, CW, RW, TWRW, 2x2 grids flat and hierarchical, uneven row splits, row
    splits across nodes flat and hierarchical, several cells on one rank, UB, DP), the pooled output of every
    feature on every rank at both steps, and every weight after two fused-optimizer steps, equal the unsharded
    model's within 1e-5; with the given pooling, optimizer, and possibly one rank sending no IDs."""
    pooling, _, _ = config
    tables, _ = _tables(ws, pooling)
    results = [{"diffs": r["training"][config]} for r in runs(ws)]
    _assert_all_close(results, "diffs", tables)


@pytest.mark.parametrize("ws", sorted(WORLDS))
def test_row_split_mean_pooling_equals_unsharded(ws: int, runs: Any) -> None:
    """MEAN tables on torchrec's RW (and TWRW) shardings, alone in their collection, train like unsharded ones
    (outputs at both steps and weights after two fused Adagrad steps within 1e-5, one rank silent)."""
    tables, _ = _row_split_mean(ws)
    _assert_all_close(runs(ws), "row_split_mean", tables)


@pytest.mark.parametrize("ws", sorted(WORLDS))
def test_row_wise_mean_beside_other_tables(ws: int, runs: Any) -> None:
    """A MEAN table laid out in torchrec's ceil row blocks (so it runs as row_wise) next to a table-wise SUM table
    and a grid SUM table in one collection: every feature's output and every weight equal the unsharded model's."""
    tables, _ = _row_split_mean_beside_others(ws)
    _assert_all_close(runs(ws), "row_split_mean_beside_others", tables)


@pytest.mark.parametrize("ws", sorted(WORLDS))
def test_layouts_get_the_intended_sharding_types(ws: int, runs: Any) -> None:
    """Each layout kind runs as intended: TW/CW/RW/TWRW/DP on torchrec's own shardings, grids and irregular row
    splits on GridPooledEmbeddingSharding (flat, hierarchical), UB tables on UniquePooledEmbeddingSharding, so the
    equality test covers every path."""
    tables, _ = _tables(ws, "mean")
    want_types = {TABLES[t.name][3] if t.name in TABLES else "embark_rb" for t in tables}
    for rank, result in enumerate(runs(ws)):
        shardings = result["inspect"]["shardings"]
        assert set(shardings) == want_types, (rank, shardings)
        for kind, cls in shardings.items():
            expected = {"embark_ub": UniquePooledEmbeddingSharding, "embark_rb": GridPooledEmbeddingSharding}.get(
                kind[:9]
            )
            assert cls == (expected.__name__ if expected else cls) and (expected is None) != kind.startswith(
                "embark_"
            ), (kind, cls)


@pytest.mark.parametrize("ws", sorted(WORLDS))
def test_state_dict_shards_are_the_layout_cells(ws: int, runs: Any) -> None:
    """The sharded module's state_dict holds, per model-parallel table, a ShardedTensor of the table's global size
    whose local shards on each rank have exactly the offsets and sizes of that rank's cells in the layout (and
    tensors of those sizes); DP tables are plain full-size tensors on every rank."""
    tables, layouts = _tables(ws, "mean")
    held = {t.name: 0 for t in tables}
    for rank, result in enumerate(runs(ws)):
        state = result["inspect"]["state"]
        assert set(state) == {f"ebc.embedding_bags.{t.name}.weight" for t in tables}
        for t in tables:
            entry = state[f"ebc.embedding_bags.{t.name}.weight"]
            if layouts[t.name].cluster == "dp":
                assert entry == ("tensor", [t.num_embeddings, t.embedding_dim]), (rank, t.name, entry)
                continue
            kind, size, shards, sizes_ok = entry
            assert kind == "sharded" and size == [t.num_embeddings, t.embedding_dim], (rank, t.name, entry)
            assert shards == _expected_cells(layouts[t.name], rank), (rank, t.name, shards)
            assert sizes_ok, (rank, t.name)
            held[t.name] += len(shards)
    for t in tables:  # every cell is held by some rank
        if layouts[t.name].cluster != "dp":
            assert held[t.name] == len(list(layouts[t.name].shards())), t.name


@pytest.mark.parametrize("target", ["table_wise", "other_grid", "uneven_cols", "multi_cell"])
def test_checkpoint_round_trips_across_plans(target: str, runs: Any) -> None:
    """torch.distributed.checkpoint between plans: a model sharded by the grid plan (4 ranks, 2 nodes) saves; a fresh
    model sharded by a different plan (all table-wise; from that checkpoint, other grids; from that, grids with
    unequal column widths, then several cells of a table on one rank) loads it in place and then holds every weight
    exactly (checked shard by shard, against the saved weights) and computes the same outputs; its shards are its own
    plan's cells."""
    results = runs(4)
    tables, _ = _tables(4, "sum")
    keys = {f"ebc.embedding_bags.{t.name}.weight" for t in tables}
    held = {t.name: 0 for t in tables}
    for rank, result in enumerate(results):
        r = result["checkpoint"][target]
        plan = result["checkpoint"]["plans"][target]
        assert set(r["after"]) == keys
        assert all(v == 0.0 for v in r["after"].values()), (rank, r["after"])
        assert set(r["output"]) == {f for t in tables for f in t.feature_names}
        assert all(v <= ATOL for v in r["output"].values()), (rank, r["output"])
        # not vacuous: the fresh model's weights differed before loading
        assert any(v > 0.0 for v in r["before"].values()), (rank, r["before"])
        for t in tables:
            entry = r["inspect"]["state"][f"ebc.embedding_bags.{t.name}.weight"]
            if plan[t.name].cluster == "dp":
                continue
            assert entry[1] == [t.num_embeddings, t.embedding_dim], (rank, t.name, entry)
            assert entry[2] == _expected_cells(plan[t.name], rank), (rank, t.name, entry)
            held[t.name] += len(entry[2])
    assert all(held[t.name] == len(list(results[0]["checkpoint"]["plans"][target][t.name].shards())) for t in tables), (
        held
    )
    kinds = set(results[0]["checkpoint"][target]["inspect"]["shardings"])
    want = {"table_wise": {"table_wise"}, "multi_cell": {"embark_rb"}}.get(target, {"embark_rb", "embark_rb_hier"})
    assert kinds == want, kinds


def _load_state_dict_check(target: str, runs: Any) -> None:
    for rank, result in enumerate(runs(4)):
        got = result["checkpoint"][target]["load_state_dict"]
        assert isinstance(got, dict), (rank, got)
        assert got and all(v == 0.0 for v in got.values()), (rank, got)


@pytest.mark.parametrize("target", ["table_wise", "other_grid"])
def test_load_state_dict_between_models_of_one_plan(target: str, runs: Any) -> None:
    """DMP.load_state_dict(other.state_dict()) between two models sharded by the same plan (one cell per table per
    rank) copies every weight exactly."""
    _load_state_dict_check(target, runs)


def test_load_state_dict_with_unequal_column_widths(runs: Any) -> None:
    """The same for the plan whose tables have column slices of unequal widths (4 and the rest), one cell per rank."""
    _load_state_dict_check("uneven_cols", runs)


def test_load_state_dict_with_several_cells_on_a_rank(runs: Any) -> None:
    """The same for the plan where one rank holds three cells of a table (equal widths): every weight exact."""
    _load_state_dict_check("multi_cell", runs)


@pytest.mark.parametrize(
    "targets, width",
    [
        ([[4, 5, 6, 7, 12, 13, 14, 15], [0, 1, 2, 3, 8, 9, 10, 11]], 16),  # cells interleaved: chunks of 4
        ([[0, 1, 2], [3, 4, 5, 6, 7]], 8),  # in order, unequal widths
        ([[5, 0, 3], [1, 4, 2]], 6),  # single columns
        ([[2, 3, 0, 1]], 4),  # one block
    ],
)
def test_block_gather_equals_split_and_column_fold(targets: list[list[int]], width: int) -> None:
    """Where every output column comes from one block, BlockGather gives what splitting the flat message, viewing
    its blocks and ColumnFold give, forward and backward, for any batch size."""
    arrays = [np.asarray(t) for t in targets]
    gather, fold = BlockGather(arrays, width, torch.device("cpu")), ColumnFold(arrays, width, torch.device("cpu"))
    assert gather.applies
    widths = [len(t) for t in targets]
    for rows in (3, 0, 5):
        flat = torch.randn(rows * sum(widths), requires_grad=True)
        split = [b.view(rows, w) for b, w in zip(torch.split(flat, [rows * w for w in widths]), widths)]
        expected, got = fold(split), gather(flat, rows)
        assert torch.equal(got, expected)
        grad = torch.randn(rows, width)
        assert torch.equal(*(torch.autograd.grad(out, flat, grad)[0] for out in (got, expected)))


def test_block_gather_needs_each_column_once() -> None:
    """Columns from two blocks (summed) or from none are ColumnFold's to assemble."""
    cpu = torch.device("cpu")
    assert not BlockGather([np.arange(4), np.arange(4)], 4, cpu).applies
    assert not BlockGather([np.arange(3)], 4, cpu).applies
