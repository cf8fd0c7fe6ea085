"""Sequence embeddings (TorchRec's EmbeddingCollection) sharded by EmbarkEmbeddingCollectionSharder train exactly like
an unsharded EmbeddingCollection: per feature, each ID's vector in sequence order (and the lengths), at both steps, and
every weight after two fused-optimizer steps.

One spawn per world size (2; 3 on one node; 4 as 2 nodes x 2). Each model holds a table for every layout kind:
TorchRec's table-wise and row-wise, a 2 x 2 grid with uneven rows (two features), row splits with uneven slices,
several cells of one table on one rank, column slices (as our grid: TorchRec's sequence column-wise needs one width for
every table), and unique-based tables (grid, row split). The grid holders see one cell width and several; at 3 ranks
one rank holds no UB cell, at 4 one holds no grid cell and two hold no UB cell. Batches have empty sequences;
configurations cover fused SGD and Adagrad, uniform and Zipf IDs (repeats: UB sums gradients per distinct ID), and a
rank that sends no IDs. The same spawns check wire precision per cluster, bad IDs, and byte counting.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.groups import sharding_group
from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision
from embark_torchrec.plan.layout.torchrec_types import ceil_row_bounds
from embark_torchrec.sharding.comm_stats import CommKey, enable_comm_stats
from embark_torchrec.sharding.sequence import GridSequenceEmbeddingSharding, UniqueSequenceEmbeddingSharding
from embark_torchrec.sharding.sharded_ec import EmbarkShardedEmbeddingCollection
from embark_torchrec.sharding.validation import InvalidIdError
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.sequence import compare_sharded_sequence_training, sharded_sequence_model

pytestmark = pytest.mark.torchrec_version

ATOL = 1e-5
DIM = 8
WORLDS = {2: 2, 3: 3, 4: 2}  # world size -> local world size (3 ranks on one node; 4 as 2 nodes x 2)
# (optimizer, ids, silent rank?)
CONFIGS = [("sgd", "uniform", False), ("adagrad", "zipf", True), ("sgd", "zipf", True)]
FP16, FP8, BF16 = WirePrecision("fp16", "fp16"), WirePrecision("fp8", "fp8"), WirePrecision("bf16", "bf16")


def _layouts(ws: int) -> dict[str, tuple[int, int, str, TableLayout]]:
    """name -> (rows, features, expected sharding type, layout)."""
    last = ws - 1
    return {
        "tw": (20, 1, "table_wise", TableLayout.table_wise(20, DIM, last)),
        "rw": (31, 1, "row_wise", TableLayout("rb", ceil_row_bounds(31, ws), (0, DIM), tuple((k,) for k in range(ws)))),
        "grid": (40, 2, "embark_rb", TableLayout("rb", (0, 13, 40), (0, 4, DIM), ((0, 1), (last, 0)))),
        "uneven": (
            37,
            1,
            "embark_rb",
            TableLayout("rb", (0, 3, 37), (0, DIM), ((1,), (0,)))
            if ws == 2
            else TableLayout("rb", (0, 3, 20, 37), (0, DIM), ((0,), (last,), (1,))),
        ),
        "multi": (33, 1, "embark_rb", TableLayout("rb", (0, 7, 20, 33), (0, 4, DIM), ((0, 0), (last, 0), (0, 1)))),
        "cw": (18, 1, "embark_rb", TableLayout("rb", (0, 18), (0, 4, DIM), ((1, 0),))),
        "ub_grid": (24, 1, "embark_ub", TableLayout("ub", (0, 12, 24), (0, 4, DIM), ((last, 0), (0, last)))),
        "ub_rw": (30, 2, "embark_ub", TableLayout("ub", (0, 5, 30), (0, DIM), ((0,), (last,)))),
    }


def _precision_layouts(ws: int) -> dict[str, tuple[int, int, str, TableLayout]]:
    """A grid table at fp8 and a UB table at fp16, next to an fp32 grid table."""
    last = ws - 1
    return {
        "grid_fp8": (
            40,
            1,
            "embark_rb:fp8-fp8",
            TableLayout("rb", (0, 13, 40), (0, 4, DIM), ((0, 1), (last, 0)), precision=FP8),
        ),
        "ub_fp16": (
            24,
            1,
            "embark_ub:fp16-fp16",
            TableLayout("ub", (0, 12, 24), (0, DIM), ((last,), (0,)), precision=FP16),
        ),
        "grid": (40, 1, "embark_rb", TableLayout("rb", (0, 13, 40), (0, 4, DIM), ((1, 0), (0, last)))),
    }


def _torchrec_precision_layouts(ws: int) -> dict[str, tuple[int, int, str, TableLayout]]:
    """TorchRec's table-wise at fp16 and at fp8 (where the plan chose TorchRec's), and row-wise at bf16 (its sequence
    shardings, the plan's codecs their registry), next to an fp32 grid table."""
    last = ws - 1
    tw_fp8 = replace(TableLayout.table_wise(26, DIM, 0), precision=FP8, torchrec_at_fp8=True)
    return {
        "tw_fp16": (20, 1, "table_wise:fp16-fp16", replace(TableLayout.table_wise(20, DIM, last), precision=FP16)),
        "tw_fp8": (26, 2, f"table_wise:fp8-fp8@{DIM}", tw_fp8),
        "rw_bf16": (
            31,
            1,
            "row_wise:bf16-bf16",
            TableLayout("rb", ceil_row_bounds(31, ws), (0, DIM), tuple((k,) for k in range(ws)), precision=BF16),
        ),
        "grid": (40, 1, "embark_rb", TableLayout("rb", (0, 13, 40), (0, 4, DIM), ((1, 0), (0, last)))),
    }


def _tables(spec: dict[str, tuple[int, int, str, TableLayout]]) -> tuple[list[EmbeddingConfig], dict[str, TableLayout]]:
    configs = [
        EmbeddingConfig(
            name=name, num_embeddings=rows, embedding_dim=DIM, feature_names=[f"{name}_f{i}" for i in range(n)]
        )
        for name, (rows, n, _, _) in spec.items()
    ]
    return configs, {name: entry[3] for name, entry in spec.items()}


# ---------------------------------------------------------------- in each rank (module level: must pickle)


def _sharded_ec(model: torch.nn.Module) -> EmbarkShardedEmbeddingCollection:
    (found,) = [m for m in model.modules() if isinstance(m, EmbarkShardedEmbeddingCollection)]
    return found


def _bad_ids(lws: int) -> dict[str, str]:
    """The error each bad batch raises (its message), or "no error"."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    tables, layouts = _tables(_layouts(ws))
    model = sharded_sequence_model(tables, layouts, lws)
    out = {}
    for case, bad in (("past_rows", 40), ("negative", -1)):
        kjt = global_kjt_batch(tables, ws, 4, seed=5)[rank]
        values = kjt.values().clone()
        start = kjt.offset_per_key()[kjt.keys().index("grid_f1")]
        values[start] = bad
        bad_kjt = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
        try:
            model(bad_kjt)
            out[case] = "no error"
        except InvalidIdError as exc:
            out[case] = str(exc)
    return out


def _expected_embedding_bytes(kjt: KeyedJaggedTensor, name: str, layout: TableLayout, rank: int) -> int:
    """Bytes of vectors that come back to `rank` for one table's features: per ID (per distinct ID and row slice for
    UB), one row of each cell of its row slice held elsewhere, fp32."""
    total = 0
    for key, ids in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())):
        if not key.startswith(f"{name}_f"):
            continue
        slices = np.searchsorted(np.asarray(layout.row_bounds), ids.numpy(), side="right") - 1
        if layout.cluster == "ub":
            slices = np.unique(np.stack([slices, ids.numpy()]), axis=1)[0]
        for s in slices.tolist():
            total += sum(
                4 * (layout.col_bounds[c + 1] - layout.col_bounds[c])
                for c, holder in enumerate(layout.ranks[s])
                if holder != rank
            )
    return total


def _comm_bytes(lws: int) -> dict[str, tuple[int, int, int]]:
    """Per embark table: (embeddings received, gradients sent) as counted over two steps, and as expected."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    spec = _layouts(ws)
    tables, layouts = _tables(spec)
    model = sharded_sequence_model(tables, layouts, lws)
    stats = enable_comm_stats(model)  # finds the sharded EC in the model, as for EBCs
    assert _sharded_ec(model).comm_stats is stats and enable_comm_stats(model) is stats
    expected = {name: 0 for name, entry in spec.items() if entry[2].startswith("embark_")}
    for step in range(2):
        kjt = global_kjt_batch(tables, ws, 4, seed=50 + step, ids="zipf")[rank]
        out = model(kjt)
        out = out.wait() if hasattr(out, "wait") else out
        sum((jt.values() ** 2).sum() for jt in out.values()).backward()
        for name in expected:
            expected[name] += _expected_embedding_bytes(kjt, name, layouts[name], rank)
    counted = {}
    for name, want in expected.items():
        kind = spec[name][2]
        received = int(stats.per_peer(CommKey(kind, name, "embeddings"))[1].sum())
        gradients = int(stats.per_peer(CommKey(kind, name, "gradients"))[0].sum())
        counted[name] = (received, gradients, want)
    return counted


def _run_world(lws: int) -> dict[str, Any]:
    ws = dist.get_world_size()
    tables, layouts = _tables(_layouts(ws))
    out: dict[str, Any] = {"training": {}}
    for optimizer, ids, silent in CONFIGS:
        out["training"][(optimizer, ids, silent)] = compare_sharded_sequence_training(
            tables, layouts, lws, optimizer=optimizer, ids=ids, silent_rank=ws - 1 if silent else None, seed=ws
        )
    model = sharded_sequence_model(tables, layouts, lws)
    module = _sharded_ec(model)
    out["shardings"] = {t: type(s).__name__ for t, s in module._sharding_type_to_sharding.items()}
    p_tables, p_layouts = _tables(_precision_layouts(ws))
    out["precision"] = compare_sharded_sequence_training(p_tables, p_layouts, lws, optimizer="adagrad", seed=ws + 1)
    # SGD: Adagrad's first step divides each gradient by its own magnitude, so where a row-wise table's two rounded
    # gradients of one row nearly cancel, its update may flip by 2 x lr, which no bound of the wire's rounding covers
    t_tables, t_layouts = _tables(_torchrec_precision_layouts(ws))
    out["torchrec_precision"] = compare_sharded_sequence_training(t_tables, t_layouts, lws, seed=ws + 2)
    out["bad_ids"] = _bad_ids(lws)
    out["bytes"] = _comm_bytes(lws)
    return out


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda ws: f"{ws}ranks")
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ws = request.param
    return ws, run_ranks(_run_world, ws, args=(WORLDS[ws],), local_world_size=WORLDS[ws], timeout_s=400)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(x) for x in c))
def test_sequence_training_equals_unsharded(world: tuple[int, list[dict[str, Any]]], config: tuple) -> None:
    """Every layout kind at once: on every rank, each feature's vectors (one per ID, in sequence order, same lengths)
    at both steps, and every table's weights after two fused steps, equal the unsharded EmbeddingCollection's."""
    ws, results = world
    tables, _ = _tables(_layouts(ws))
    expected = {f"step{s}/{f}" for s in range(2) for t in tables for f in t.feature_names} | {
        f"weight/ec.embeddings.{t.name}.weight" for t in tables
    }
    for rank, result in enumerate(results):
        diffs = result["training"][config]
        assert set(diffs) == expected, (rank, sorted(set(diffs) ^ expected))
        bad = {k: v for k, v in diffs.items() if not v <= ATOL}
        assert not bad, f"{ws} ranks, rank {rank}, {config}: {bad}"


def test_layouts_get_the_intended_sharding_types(world: tuple[int, list[dict[str, Any]]]) -> None:
    """Table-wise and ceil row blocks run on TorchRec's own sequence shardings; grids, uneven row splits, column
    slices and several cells on a rank on GridSequenceEmbeddingSharding; UB tables on UniqueSequenceEmbeddingSharding,
    so the equality test covers each path."""
    ws, results = world
    want = {
        "table_wise": "TwSequenceEmbeddingSharding",
        "row_wise": "RwSequenceEmbeddingSharding",
        "embark_rb": GridSequenceEmbeddingSharding.__name__,
        "embark_ub": UniqueSequenceEmbeddingSharding.__name__,
    }
    for result in results:
        assert result["shardings"] == want


def test_wire_precision_per_cluster(world: tuple[int, list[dict[str, Any]]]) -> None:
    """A grid cluster at fp8 and a UB cluster at fp16 (plan precision, forward and backward): their vectors and
    weights stay within the codecs' error (fp16: 2^-11 relative; fp8: 2^-4 relative, here on values below 1) and do
    differ from fp32, so the codecs ran; the fp32 grid table next to them stays exact."""
    ws, results = world
    for rank, diffs in enumerate(r["precision"] for r in results):
        fp8 = [v for k, v in diffs.items() if "grid_fp8" in k]
        fp16 = [v for k, v in diffs.items() if "ub_fp16" in k]
        exact = [v for k, v in diffs.items() if k.endswith(("/grid_f0", ".grid.weight"))]
        assert fp8 and max(fp8) <= 0.1 and max(fp8) > 0, (rank, diffs)
        assert fp16 and max(fp16) <= 2e-3 and max(fp16) > 0, (rank, diffs)
        assert exact and max(exact) <= ATOL, (rank, diffs)


def test_torchrec_types_keep_their_sharding_below_fp32(world: tuple[int, list[dict[str, Any]]]) -> None:
    """TorchRec's table-wise at fp16 and at fp8 (the plan's torchrec_at_fp8) and row-wise at bf16 (plan precision,
    both ways) keep TorchRec's sequence shardings, and their vectors and weights after two SGD steps stay within a
    few roundings of the wire (fp16 2^-11, bf16 2^-8, fp8 2^-4 relative, on values below 1) and differ from fp32 (the
    codecs ran); the fp32 grid beside them is exact."""
    ws, results = world
    for name, (rows, _, kind, layout) in _torchrec_precision_layouts(ws).items():
        assert sharding_group(layout, rows, ws, WORLDS[ws], sequence=True).name == kind, name
    for rank, diffs in enumerate(r["torchrec_precision"] for r in results):
        for table, bound in (("tw_fp16", 2e-3), ("rw_bf16", 1.6e-2), ("tw_fp8", 0.1)):
            found = [v for k, v in diffs.items() if table in k]
            assert found and 0 < max(found) <= bound, (rank, table, diffs)
        exact = [v for k, v in diffs.items() if k.endswith(("/grid_f0", ".grid.weight"))]
        assert exact and max(exact) <= ATOL, (rank, diffs)


def test_bad_ids_are_refused_by_name(world: tuple[int, list[dict[str, Any]]]) -> None:
    """An ID past a table's rows, or a negative one, in any rank's batch raises InvalidIdError naming the rank, the
    feature and the table, before any collective."""
    ws, results = world
    for rank, result in enumerate(results):
        for case, message in result["bad_ids"].items():
            assert f"rank {rank}" in message and "'grid_f1'" in message and "'grid'" in message, (case, message)


def test_counted_bytes_equal_what_was_sent(world: tuple[int, list[dict[str, Any]]]) -> None:
    """With counting turned on by enable_comm_stats (which finds the sharded EC), the vectors each embark table's
    dists bring home over two steps (and the gradients sent back, the same bytes) equal one fp32 row per ID and remote
    cell of its row slice (per distinct ID for UB), as worked out from the batch; the counters also check each message
    against the payload handed to the all-to-all."""
    ws, results = world
    for rank, result in enumerate(results):
        for table, (received, gradients, want) in result["bytes"].items():
            assert received == gradients == want, (rank, table, received, gradients, want)
        assert any(want for _, _, want in result["bytes"].values())
