"""A layout TorchRec runs stays on TorchRec's own sharding below fp32: the plan's precision reaches it as a per-group
codec registry, as QCommsConfig's codecs do, under a sharding-type string of its own ("table_wise:fp16-fp16"), so
that one module holds its fp32 and its compressed table-wise tables in two groups. At fp8, which scales each vector
and so needs each row's width while TorchRec's dists size a message by its element count alone, table-wise and
column-wise tables run on TorchRec's sharding one group per row width ("table_wise:fp8-fp8@12"), our row-scaled
codec told that width; row-wise and table-row-wise ones, whose partial sums TorchRec reduce-scatters (and sends at
fp16 / bf16 for FP8), run on our dists, which send them at fp8.

- planning: the group strings, their collectives and ID bytes (TorchRec's), and fp8's;
- runtime, one 4-rank spawn (2 nodes x 2): every compressed group is its sharding class, its collectives carry the
  plan's codecs each way (at fp8 told the group's row width), its outputs and trained weights stay within the
  wire's rounding of the unsharded fp32 model and really differ from it (the precision is applied), and the fp32
  table-wise table beside them is exact; a row-wise MEAN table at fp16 is divided by its bag lengths (TorchRec's
  MEAN fix-up covers the compressed group).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from embark_torchrec.plan.layout.groups import ShardingGroup, sharding_group
from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision
from embark_torchrec.plan.layout.wire import TORCHREC_ID_BYTES
from embark_torchrec.sharding.torchrec_compat import (
    collective_codecs,
    module_output_dists,
    module_sharding_types,
    module_shardings,
)
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.training import compare_sharded_training, sharded_model

WS, LWS = 4, 2
FP16, BF16, FP8 = WirePrecision("fp16", "fp16"), WirePrecision("bf16", "bf16"), WirePrecision("fp8", "fp8")
TABLES = [
    EmbeddingBagConfig(name="tw", num_embeddings=20, embedding_dim=12, feature_names=["t0", "t1"]),
    EmbeddingBagConfig(name="tw32", num_embeddings=16, embedding_dim=8, feature_names=["s"]),
    EmbeddingBagConfig(name="cw", num_embeddings=20, embedding_dim=8, feature_names=["c"]),
    EmbeddingBagConfig(name="rw", num_embeddings=22, embedding_dim=8, feature_names=["w"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="twrw", num_embeddings=18, embedding_dim=4, feature_names=["x"]),
    EmbeddingBagConfig(name="tw8", num_embeddings=20, embedding_dim=12, feature_names=["e0", "e1"]),
    EmbeddingBagConfig(name="tw8_narrow", num_embeddings=16, embedding_dim=8, feature_names=["n"]),
    EmbeddingBagConfig(name="cw8", num_embeddings=20, embedding_dim=8, feature_names=["k"]),
    EmbeddingBagConfig(name="rw8", num_embeddings=22, embedding_dim=8, feature_names=["v"]),
]
LAYOUTS = {
    "tw": replace(TableLayout.table_wise(20, 12, 3), precision=FP16),
    "tw32": TableLayout.table_wise(16, 8, 1),
    "cw": TableLayout("rb", (0, 20), (0, 4, 8), ((0, 3),), BF16),
    "rw": TableLayout("rb", (0, 6, 12, 18, 22), (0, 8), ((0,), (1,), (2,), (3,)), WirePrecision("fp16", "bf16")),
    "twrw": TableLayout("rb", (0, 9, 18), (0, 4), ((2,), (3,)), FP16, hierarchical=True),
    "tw8": replace(TableLayout.table_wise(20, 12, 1), precision=FP8, torchrec_at_fp8=True),
    "tw8_narrow": replace(
        TableLayout.table_wise(16, 8, 2), precision=WirePrecision("fp16", "fp8"), torchrec_at_fp8=True
    ),
    "cw8": TableLayout("rb", (0, 20), (0, 4, 8), ((3, 0),), FP8, torchrec_at_fp8=True),
    "rw8": TableLayout("rb", (0, 6, 12, 18, 22), (0, 8), ((0,), (1,), (2,), (3,)), FP8),
}
GROUPS = {
    "tw": "table_wise:fp16-fp16",
    "tw32": "table_wise",
    "cw": "column_wise:bf16-bf16",
    "rw": "row_wise:fp16-bf16",
    "twrw": "table_row_wise:fp16-fp16",
    "tw8": "table_wise:fp8-fp8@12",
    "tw8_narrow": "table_wise:fp16-fp8@8",
    "cw8": "column_wise:fp8-fp8@4",
}
OURS = {"rw8": "embark_rb:fp8-fp8"}
SHARDING_CLASSES = {
    "table_wise:fp16-fp16": "TwPooledEmbeddingSharding",
    "table_wise": "TwPooledEmbeddingSharding",
    "column_wise:bf16-bf16": "CwPooledEmbeddingSharding",
    "row_wise:fp16-bf16": "RwPooledEmbeddingSharding",
    "table_row_wise:fp16-fp16": "TwRwPooledEmbeddingSharding",
    "table_wise:fp8-fp8@12": "TwPooledEmbeddingSharding",
    "table_wise:fp16-fp8@8": "TwPooledEmbeddingSharding",
    "column_wise:fp8-fp8@4": "CwPooledEmbeddingSharding",
    "embark_rb:fp8-fp8": "GridPooledEmbeddingSharding",
}
# relative rounding of one value on the wire (codecs.py)
UNIT = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8, "fp8": 2.0**-4}


def _rows(name: str) -> int:
    return next(t.num_embeddings for t in TABLES if t.name == name)


@pytest.mark.parametrize("table", sorted(GROUPS))
def test_torchrec_layouts_keep_their_type_below_fp32(table: str) -> None:
    """A TorchRec-shaped layout below fp32 is TorchRec's type with the precision in its string (at fp8 also its rows'
    width), priced with TorchRec's collectives and int64 IDs."""
    layout = LAYOUTS[table]
    group = sharding_group(layout, _rows(table), WS, LWS)
    assert group.name == GROUPS[table]
    base = GROUPS[table].partition(":")[0]
    assert group.torchrec_type == base
    assert group.precision == layout.precision
    assert group.collectives_per_step == ShardingGroup.parse(base).collectives_per_step
    assert group.id_bytes == TORCHREC_ID_BYTES


@pytest.mark.parametrize("table", sorted(set(GROUPS) - {"tw32"}))
@pytest.mark.parametrize("fp8", [FP8, WirePrecision("fp16", "fp8"), WirePrecision("fp8", "fp32")], ids=str)
def test_at_fp8_table_and_column_wise_run_on_torchrecs_one_group_per_width_where_chosen(
    table: str, fp8: WirePrecision
) -> None:
    """At fp8 either way, a table-wise or column-wise layout (column slices of one width) whose torchrec_at_fp8 is set
    is TorchRec's type, its string naming the width its row-scaled codec is told; unset, it is ours. A row-wise or
    table-row-wise one, and a column-wise one of uneven slices, cannot be TorchRec's at fp8: always ours."""
    layout = replace(LAYOUTS[table], precision=fp8, torchrec_at_fp8=False)
    ours = sharding_group(layout, _rows(table), WS, LWS)
    assert ours.name.startswith("embark_rb") and ours.torchrec_type is None, ours
    base = GROUPS[table].partition(":")[0]
    if base in ("table_wise", "column_wise"):
        width = layout.col_bounds[1] - layout.col_bounds[0]
        group = sharding_group(replace(layout, torchrec_at_fp8=True), _rows(table), WS, LWS)
        assert group.name == f"{base}:{fp8.forward}-{fp8.backward}@{width}"
        assert (group.torchrec_type, group.precision, group.row_width) == (base, fp8, width)
        assert group.collectives_per_step == ShardingGroup.parse(base).collectives_per_step
        assert group.id_bytes == TORCHREC_ID_BYTES
        assert TableLayout("rb", (0, 20), (0, 4, 12), ((0, 1),), fp8).fp8_builtin_type() is None  # uneven slices
    else:
        assert layout.fp8_builtin_type() is None


def test_sequence_tables_keep_torchrec_types_below_fp32() -> None:
    """An EmbeddingCollection's table-wise and row-wise tables stay TorchRec's at fp16 too, and its table-wise ones at
    fp8 (column-wise, which TorchRec runs only for tables of one width, stays ours at every precision)."""
    assert sharding_group(LAYOUTS["tw"], 20, WS, LWS, sequence=True).name == "table_wise:fp16-fp16"
    assert sharding_group(LAYOUTS["rw"], 22, WS, LWS, sequence=True).name == "row_wise:fp16-bf16"
    assert sharding_group(LAYOUTS["cw"], 20, WS, LWS, sequence=True).name.startswith("embark_rb")
    assert sharding_group(LAYOUTS["tw8"], 20, WS, LWS, sequence=True).name == "table_wise:fp8-fp8@12"
    assert sharding_group(LAYOUTS["rw8"], 22, WS, LWS, sequence=True).name == "embark_rb:fp8-fp8"


def _run() -> dict[str, Any]:
    model = sharded_model(TABLES, LAYOUTS, LWS)
    batch = global_kjt_batch(TABLES, WS, 4, seed=3)[dist.get_rank()]
    model(batch)  # TorchRec builds its pooled collectives on first use
    (ebc,) = [m for m in model.modules() if hasattr(m, "_embedding_shardings")]
    groups: dict[str, Any] = {}
    for sharding_type, sharding, output_dist in zip(
        module_sharding_types(ebc), module_shardings(ebc), module_output_dists(ebc)
    ):
        codecs = [
            None
            if c is None
            else tuple((x.wire_precision, getattr(x, "row_width", 0)) for x in (c.forward, c.backward))
            for c in (collective_codecs(m) for m in output_dist.modules() if hasattr(m, "_codecs"))
        ]
        groups[sharding_type] = (type(sharding).__name__, codecs)
    return {"groups": groups, "diffs": compare_sharded_training(TABLES, LAYOUTS, LWS, steps=2, ids="zipf")}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_run, WS, local_world_size=LWS, timeout_s=600)


def test_compressed_groups_run_on_torchrec_shardings_with_the_plans_codecs(results: list[dict[str, Any]]) -> None:
    """Each group is its sharding class (TorchRec's, ours for row-wise at fp8), and each of its output collectives
    (TWRW: both hops) carries the plan's codecs forward and backward, an fp8 one on TorchRec's dists told the group's
    row width; the fp32 group carries none."""
    for r in results:
        assert sorted(r["groups"]) == sorted(SHARDING_CLASSES)
        for sharding_type, (name, codecs) in r["groups"].items():
            assert name == SHARDING_CLASSES[sharding_type], sharding_type
            assert codecs, sharding_type
            group = ShardingGroup.parse(sharding_type)
            p, width = group.precision, group.row_width
            expected = tuple((x, width if x == "fp8" else 0) for x in (p.forward, p.backward))
            assert all(c == (None if sharding_type == "table_wise" else expected) for c in codecs), (group, codecs)


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
