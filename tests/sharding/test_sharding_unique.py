"""Unique-based (UB) tables train exactly like an unsharded EmbeddingBagCollection.

One spawn per world size (2, 3, and 4 as 2 nodes x 2); each model holds a UB table for every layout kind the
planner emits (table-wise, column-wise with uneven widths and a rank twice, row-split with uneven slices, a grid,
several cells of one row slice on one rank) next to an RB grid table. Data: Zipf(1.1) IDs (heavy repetition, so
de-duplication and the per-ID gradient sums matter) and IDs that never repeat, over sum / mean / weighted pooling
and fused SGD / Adagrad, one configuration with a silent rank, and both ways a holder can look its distinct IDs up
(padded, the CPU default, and fbgemm's variable-batch lookup, the GPU default). Outputs at both steps and weights
after two steps must match to 1e-5.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.sharding.grid import CellRoute
from embark_torchrec.sharding.unique import KEY_INT32_LIMIT, UniqueLayout, UniqueSparseFeaturesDist
from embark_torchrec.testing import fake_world, run_ranks
from embark_torchrec.testing.training import compare_sharded_training

pytestmark = pytest.mark.torchrec_version

ATOL = 1e-5
WORLDS = {2: 2, 3: 3, 4: 2}
# (pooling, optimizer, ids, silent rank?, unique_lookup)
CONFIGS = [
    ("sum", "sgd", "zipf", False, "auto"),
    ("mean", "adagrad", "distinct", False, "auto"),
    ("weighted", "adagrad", "zipf", True, "auto"),
    ("sum", "adagrad", "distinct", True, "auto"),
    ("mean", "sgd", "zipf", False, "auto"),
    ("sum", "sgd", "zipf", True, "variable_batch"),
    ("weighted", "sgd", "distinct", False, "variable_batch"),
]


def _layouts(ws: int) -> dict[str, tuple[int, int, int, TableLayout]]:
    """name -> (rows, dim, features, layout); every rank number is taken modulo the world size."""
    last = ws - 1
    return {
        "ub_tw": (40, 8, 2, TableLayout("ub", (0, 40), (0, 8), ((last,),))),
        "ub_cw": (48, 12, 1, TableLayout("ub", (0, 48), (0, 4, 8, 12), ((1, 1 % ws, 0),))),
        "ub_rw": (50, 8, 1, TableLayout("ub", (0, 3, 29, 50), (0, 8), ((0,), (last,), (1,)))),
        "ub_grid": (44, 16, 2, TableLayout("ub", (0, 17, 44), (0, 4, 16), ((last, 0), (1, last)))),
        "ub_same_rank": (36, 8, 1, TableLayout("ub", (0, 20, 36), (0, 4, 8), ((0, 0), (1, last)))),
        "rb_grid": (30, 8, 1, TableLayout("rb", (0, 11, 30), (0, 8), ((1,), (0,)))),
    }


def _tables(ws: int, pooling: str) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    configs, layouts = [], {}
    for name, (rows, dim, n_features, layout) in _layouts(ws).items():
        configs.append(
            EmbeddingBagConfig(
                name=name,
                num_embeddings=rows,
                embedding_dim=dim,
                feature_names=[f"{name}_f{i}" for i in range(n_features)],
                pooling=PoolingType.MEAN if pooling == "mean" else PoolingType.SUM,
            )
        )
        layouts[name] = layout
    return configs, layouts


def _train_configs(configs: Any, build: Any, lws: int) -> dict[Any, dict[str, float]]:
    """Per config (pooling, optimizer, ids, silent rank, lookup): sharded vs unsharded weight diffs after two steps
    of the tables `build(world size, pooling)` lays out."""
    ws = dist.get_world_size()
    out = {}
    for pooling, optimizer, ids, silent, lookup in configs:
        tables, layouts = build(ws, pooling)
        out[(pooling, optimizer, ids, silent, lookup)] = compare_sharded_training(
            tables,
            layouts,
            lws,
            steps=2,
            optimizer=optimizer,
            weighted=pooling == "weighted",
            batch_per_rank=8,
            seed=ws,
            silent_rank=ws - 1 if silent else None,
            ids=ids,
            unique_lookup=lookup,
        )
    return out


def _run_world(lws: int) -> dict[Any, dict[str, float]]:
    return _train_configs(CONFIGS, _tables, lws)


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda ws: f"{ws}ranks")
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[Any, dict[str, float]]]]:
    ws = request.param
    return ws, run_ranks(_run_world, ws, args=(WORLDS[ws],), local_world_size=WORLDS[ws], timeout_s=600)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(x) for x in c))
def test_unique_based_matches_unsharded(world: tuple[int, list[dict[Any, dict[str, float]]]], config: tuple) -> None:
    """Every UB layout: outputs at each step and weights after two steps equal the unsharded model's."""
    ws, results = world
    for rank, per_config in enumerate(results):
        diffs = per_config[config]
        assert any(k.startswith("weight/") and "ub_grid" in k for k in diffs), "the UB grid's weights were not compared"
        bad = {k: v for k, v in diffs.items() if v > ATOL}
        assert not bad, f"{ws} ranks, rank {rank}, {config}: {bad}"


# Full-width UB: every cell a whole row slice of one common width, so the distinct vectors come back
# as rows of one table and the sender only shifts each key's row (UniquePooledEmbeddingDist._table).
FULL_WIDTH_CONFIGS = [
    ("sum", "sgd", "zipf", False, "auto"),
    ("mean", "adagrad", "distinct", True, "auto"),
    ("weighted", "sgd", "zipf", False, "variable_batch"),
]


def _full_width_tables(ws: int, pooling: str) -> tuple[list[EmbeddingBagConfig], dict[str, TableLayout]]:
    """Row slices placed so that a rank's groups are not in feature order (the sender permutes them)."""
    last = ws - 1
    specs = {
        "fw_tw": (40, 2, TableLayout("ub", (0, 40), (0, 8), ((last,),))),
        "fw_rw": (50, 1, TableLayout("ub", (0, 3, 29, 50), (0, 8), ((1,), (0,), (last,)))),
        "fw_rw2": (30, 2, TableLayout("ub", (0, 11, 30), (0, 8), ((0,), (1,)))),
    }
    configs = [
        EmbeddingBagConfig(
            name=name,
            num_embeddings=rows,
            embedding_dim=8,
            feature_names=[f"{name}_f{i}" for i in range(n_features)],
            pooling=PoolingType.MEAN if pooling == "mean" else PoolingType.SUM,
        )
        for name, (rows, n_features, _) in specs.items()
    ]
    return configs, {name: layout for name, (_, _, layout) in specs.items()}


def _run_full_width() -> dict[Any, dict[str, float]]:
    return _train_configs(FULL_WIDTH_CONFIGS, _full_width_tables, dist.get_world_size())


@pytest.mark.parametrize("ws", [2, 3])
def test_full_width_unique_based_matches_unsharded(ws: int) -> None:
    """Full-width UB tables (the shift-only expansion): outputs and weights equal the unsharded model's."""
    for rank, per_config in enumerate(run_ranks(_run_full_width, ws, local_world_size=ws, timeout_s=600)):
        for config, diffs in per_config.items():
            assert any(k.endswith(".fw_rw.weight") for k in diffs), "the row-split tables' weights were not compared"
            bad = {k: v for k, v in diffs.items() if v > ATOL}
            assert not bad, f"{ws} ranks, rank {rank}, {config}: {bad}"


@pytest.mark.parametrize("rows", [1_000, 2**30 + 7])
def test_de_duplication_keys_exact_at_either_key_width(rows: int) -> None:
    """The input dist de-duplicates (feature, ID) keys as int32 while every key fits and as int64 beyond that
    (two features of 2^30 + 7 rows: 2^31 + 14 keys); either way each feature's distinct IDs, the per-group counts
    and every ID's inverse equal numpy's unique over (feature, ID), also for the largest IDs."""
    cut = rows // 2
    layout = UniqueLayout.build(
        ["f0", "f1"],
        [8, 8],
        [rows, rows],
        [[0, rows], [0, cut, rows]],
        [[CellRoute(0, 0, 0), CellRoute(1, 0, 0), CellRoute(1, 1, 0)]],
        [[8, 8, 8]],
    )
    ids = [[rows - 1, 3, rows - 1, 0], [cut, rows - 1, cut - 1, cut, 5]]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.tensor(ids[0] + ids[1]), lengths=torch.tensor([2, 2, 3, 2])
    )
    with fake_world(1) as pg:
        input_dist = UniqueSparseFeaturesDist(
            pg, layout, weighted=False, mean=[False, False], device=torch.device("cpu")
        )
        input_dist(kjt)
    state = input_dist.last_state
    assert state is not None
    assert (layout.key_start[-1] > KEY_INT32_LIMIT) == (rows > 2**30)
    keys = np.array(ids[0] + [rows + i for i in ids[1]], dtype=np.int64)  # f1's keys follow f0's rows
    distinct, inverse = np.unique(keys, return_inverse=True)
    group = np.searchsorted(np.array(layout.key_start[1:]), distinct, side="right")
    assert state.inverse.tolist() == inverse.tolist()
    assert state.group_counts == np.bincount(group, minlength=layout.num_groups).tolist()
    assert state.key_group.tolist() == group.tolist()


def test_bag_sum_takes_float64_weights_as_the_tables_dtype() -> None:
    """A weighted batch may carry float64 weights (TorchRec's types take them, and so does the input check); the
    unique-based lookup sums with them as with their float32 values, forward and backward (embedding_bag takes only
    weights of the table's dtype: it raised on every rank)."""
    from embark_torchrec.sharding.unique import _BagSum

    table = torch.randn(6, 4, requires_grad=True)
    index, lengths = torch.tensor([0, 3, 3, 5]), torch.tensor([2, 0, 2])
    weights = torch.tensor([0.5, 2.0, 1.5, -1.0], dtype=torch.float64)
    results = []
    for w in (weights, weights.float()):
        out = _BagSum.apply(table, index, lengths, w)
        (grad,) = torch.autograd.grad(out.sum(), table)
        results.append((out, grad))
    assert results[0][0].dtype == torch.float32
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
