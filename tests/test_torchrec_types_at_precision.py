"""A layout TorchRec runs (table-wise, column-wise, row-wise, table-row-wise) stays on TorchRec's own sharding at
fp16 and bf16: the plan's precision reaches it as a per-group codec registry, as QCommsConfig's codecs do, under a
sharding-type string of its own ("table_wise:fp16-fp16"), so that one module holds its fp32 and its compressed
table-wise tables in two groups. fp8 scales each vector, which needs each row's width, and TorchRec's dists size a
message by its element count alone: an fp8 layout runs on our dists.

- planning: the group strings, their collectives and ID bytes (TorchRec's), and the fp8 fallback;
- runtime, one 4-rank spawn (2 nodes x 2): every compressed group is TorchRec's sharding class, its collectives carry
  the plan's codecs each way, its outputs and trained weights stay within the wire's rounding of the unsharded fp32
  model and really differ from it (the precision is applied), and the fp32 table-wise table beside them is exact;
  a row-wise MEAN table at fp16 is divided by its bag lengths (TorchRec's MEAN fix-up covers the compressed group).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from embark_torchrec.plan.groups import collectives_per_step, id_bytes, sharding_type, torchrec_type
from embark_torchrec.plan.layout import TableLayout, WirePrecision, split_precision
from embark_torchrec.plan.wire import TORCHREC_ID_BYTES
from embark_torchrec.sharding.torchrec_compat import (
    collective_codecs,
    module_output_dists,
    module_sharding_types,
    module_shardings,
)
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.training import compare_sharded_training, sharded_model

WS, LWS = 4, 2
FP16, BF16 = WirePrecision("fp16", "fp16"), WirePrecision("bf16", "bf16")
TABLES = [
    EmbeddingBagConfig(name="tw", num_embeddings=20, embedding_dim=12, feature_names=["t0", "t1"]),
    EmbeddingBagConfig(name="tw32", num_embeddings=16, embedding_dim=8, feature_names=["s"]),
    EmbeddingBagConfig(name="cw", num_embeddings=20, embedding_dim=8, feature_names=["c"]),
    EmbeddingBagConfig(name="rw", num_embeddings=22, embedding_dim=8, feature_names=["w"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="twrw", num_embeddings=18, embedding_dim=4, feature_names=["x"]),
]
LAYOUTS = {
    "tw": replace(TableLayout.table_wise(20, 12, 3), precision=FP16),
    "tw32": TableLayout.table_wise(16, 8, 1),
    "cw": TableLayout("rb", (0, 20), (0, 4, 8), ((0, 3),), BF16),
    "rw": TableLayout("rb", (0, 6, 12, 18, 22), (0, 8), ((0,), (1,), (2,), (3,)), WirePrecision("fp16", "bf16")),
    "twrw": TableLayout("rb", (0, 9, 18), (0, 4), ((2,), (3,)), FP16, hierarchical=True),
}
GROUPS = {
    "tw": "table_wise:fp16-fp16",
    "tw32": "table_wise",
    "cw": "column_wise:bf16-bf16",
    "rw": "row_wise:fp16-bf16",
    "twrw": "table_row_wise:fp16-fp16",
}
SHARDING_CLASSES = {
    "table_wise:fp16-fp16": "TwPooledEmbeddingSharding",
    "table_wise": "TwPooledEmbeddingSharding",
    "column_wise:bf16-bf16": "CwPooledEmbeddingSharding",
    "row_wise:fp16-bf16": "RwPooledEmbeddingSharding",
    "table_row_wise:fp16-fp16": "TwRwPooledEmbeddingSharding",
}
# relative rounding of one value on the wire (codecs.py)
UNIT = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}


def _rows(name: str) -> int:
    return next(t.num_embeddings for t in TABLES if t.name == name)


@pytest.mark.parametrize("table", sorted(GROUPS))
def test_torchrec_layouts_keep_their_type_at_fp16_and_bf16(table: str) -> None:
    """A TorchRec-shaped layout at an element-wise precision is TorchRec's type with the precision in its string,
    priced with TorchRec's collectives and int64 IDs; the same layout at fp8 either way is ours."""
    layout = LAYOUTS[table]
    kind = sharding_type(layout, _rows(table), WS, LWS)
    assert kind == GROUPS[table]
    base = kind.partition(":")[0]
    assert torchrec_type(kind) == base
    assert split_precision(kind)[1] == layout.precision
    assert collectives_per_step(kind) == collectives_per_step(base)
    assert id_bytes(kind) == TORCHREC_ID_BYTES
    for fp8 in (WirePrecision("fp8", "fp8"), WirePrecision("fp16", "fp8"), WirePrecision("fp8", "fp32")):
        ours = sharding_type(replace(layout, precision=fp8), _rows(table), WS, LWS)
        assert ours.startswith("embark_rb") and torchrec_type(ours) is None, ours


def test_sequence_tables_keep_torchrec_types_at_fp16() -> None:
    """An EmbeddingCollection's table-wise and row-wise tables stay TorchRec's at fp16 too (column-wise, which TorchRec
    runs only for tables of one width, stays ours at every precision)."""
    assert sharding_type(LAYOUTS["tw"], 20, WS, LWS, sequence=True) == "table_wise:fp16-fp16"
    assert sharding_type(LAYOUTS["rw"], 22, WS, LWS, sequence=True) == "row_wise:fp16-bf16"
    assert sharding_type(LAYOUTS["cw"], 20, WS, LWS, sequence=True).startswith("embark_rb")


def _run() -> dict[str, Any]:
    model = sharded_model(TABLES, LAYOUTS, LWS)
    batch = global_kjt_batch(TABLES, WS, 4, seed=3)[dist.get_rank()]
    model(batch)  # TorchRec builds its pooled collectives on first use
    (ebc,) = [m for m in model.modules() if hasattr(m, "_embedding_shardings")]
    groups: dict[str, Any] = {}
    for kind, sharding, output_dist in zip(module_sharding_types(ebc), module_shardings(ebc), module_output_dists(ebc)):
        codecs = [
            None if c is None else (c.forward.wire_precision, c.backward.wire_precision)
            for c in (collective_codecs(m) for m in output_dist.modules() if hasattr(m, "_codecs"))
        ]
        groups[kind] = (type(sharding).__name__, codecs)
    return {"groups": groups, "diffs": compare_sharded_training(TABLES, LAYOUTS, LWS, steps=2, ids="zipf")}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_run, WS, local_world_size=LWS, timeout_s=600)


def test_compressed_groups_run_on_torchrec_shardings_with_the_plans_codecs(results: list[dict[str, Any]]) -> None:
    """Each group is TorchRec's sharding class, and each of its output collectives (TWRW: both hops) carries the
    plan's codecs forward and backward; the fp32 group carries none."""
    for r in results:
        assert sorted(r["groups"]) == sorted(SHARDING_CLASSES)
        for kind, (name, codecs) in r["groups"].items():
            assert name == SHARDING_CLASSES[kind], kind
            assert codecs, kind
            p = split_precision(kind)[1]
            expected = None if kind == "table_wise" else (p.forward, p.backward)
            assert all(c == expected for c in codecs), (kind, codecs)


def test_outputs_and_weights_within_the_wire_rounding(results: list[dict[str, Any]]) -> None:
    """First-step outputs and weights after two SGD steps differ from the unsharded fp32 model by at most two
    roundings of the wire per value (a row-wise partial sum is reduced at that precision), and do differ (applied);
    the fp32 table-wise feature is exact."""
    diffs = {k: max(r["diffs"][k] for r in results) for k in results[0]["diffs"]}
    features = {f: t.name for t in TABLES for f in t.feature_names}
    for feature, table in features.items():
        p = LAYOUTS[table].precision
        out = diffs[f"step0/{feature}"]
        if table == "tw32":
            assert out <= 1e-6, (feature, out)
            continue
        assert 0.0 < out <= 8 * UNIT[p.forward] + 1e-6, (feature, out)
    for table in LAYOUTS:
        p = LAYOUTS[table].precision
        weight = max(v for k, v in diffs.items() if k.startswith("weight/") and f".{table}." in k)
        if table == "tw32":
            assert weight <= 1e-6, (table, weight)
        else:
            assert 0.0 < weight <= 4 * (UNIT[p.forward] + UNIT[p.backward]), (table, weight)
