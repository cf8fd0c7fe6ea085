"""Table layouts and the plan file: lossless round trips, and validate()/from_dict() refusing every
broken plan with a PlanError that names the table (or the rank)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.tables import PLAN_FORMAT, PLAN_VERSION, Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology

W, L = 8, 4

SPEC = ModelSpec(
    "layouts",
    1024,
    (
        TableSpec("dp", 100, 16, 1.0),
        TableSpec("tw", 1000, 32, 2.0),
        TableSpec("cw", 500, 64, 1.0),
        TableSpec("uneven", 1001, 16, 3.0),
        TableSpec("grid", 999, 24, 1.0),
        TableSpec("twrw", 4000, 8, 1.0),
    ),
)


def _plan() -> Plan:
    """One layout of every kind, with non-default precisions and hierarchical flags."""
    return Plan(
        W,
        L,
        {
            "dp": TableLayout.data_parallel(WirePrecision("fp32", "bf16")),
            "tw": TableLayout.table_wise(1000, 32, 5),
            "cw": TableLayout("rb", (0, 500), (0, 12, 40, 64), ((2, 7, 0),), WirePrecision("fp16", "fp16")),
            "uneven": TableLayout("ub", (0, 1, 400, 1001), (0, 16), ((3,), (3,), (6,)), WirePrecision("fp8", "bf16")),
            # a grid whose ranks repeat across cells, rows and columns
            "grid": TableLayout("rb", (0, 333, 334, 999), (0, 8, 24), ((1, 3), (4, 3), (1, 3)), hierarchical=True),
            "twrw": TableLayout("rb", (0, 1000, 2000, 3000, 4000), (0, 8), ((4,), (5,), (6,), (7,)), hierarchical=True),
        },
    )


def _entry(d: dict, table: str) -> dict:
    return d["tables"][table]


# ---- round trips ------------------------------------------------------------------------------


def test_plan_file_round_trip_is_lossless() -> None:
    """to_dict -> JSON text -> from_dict gives back an equal Plan for dp, table-wise, column-wise,
    uneven row splits and grids with repeated ranks, keeping precisions and hierarchical flags."""
    plan = _plan()
    plan.validate(SPEC)
    text = json.dumps(plan.to_dict())
    again = Plan.from_dict(json.loads(text))
    assert again == plan
    for name, layout in plan.tables.items():
        assert again[name] == layout
        assert again[name].precision == layout.precision
        assert again[name].hierarchical == layout.hierarchical
    assert again.to_dict() == plan.to_dict()
    assert list(again.tables) == list(plan.tables)


def test_plan_file_format() -> None:
    """The plan file has the documented header, DP tables have no shards, and every other table
    lists its cells row-major as {"rows", "cols", "rank"} half-open ranges."""
    d = _plan().to_dict()
    assert (d["format"], d["version"], d["world_size"], d["local_world_size"]) == (PLAN_FORMAT, PLAN_VERSION, W, L)
    assert d["format"] == "embark-plan" and d["version"] == 1
    assert _entry(d, "dp") == {"cluster": "dp", "precision": {"forward": "fp32", "backward": "bf16"}, "shards": []}
    assert _entry(d, "tw")["shards"] == [{"rows": [0, 1000], "cols": [0, 32], "rank": 5}]
    assert _entry(d, "grid")["shards"] == [
        {"rows": [0, 333], "cols": [0, 8], "rank": 1},
        {"rows": [0, 333], "cols": [8, 24], "rank": 3},
        {"rows": [333, 334], "cols": [0, 8], "rank": 4},
        {"rows": [333, 334], "cols": [8, 24], "rank": 3},
        {"rows": [334, 999], "cols": [0, 8], "rank": 1},
        {"rows": [334, 999], "cols": [8, 24], "rank": 3},
    ]
    assert _entry(d, "grid")["hierarchical"] is True
    assert "hierarchical" not in _entry(d, "tw")


def test_save_load_round_trip(tmp_path: Path) -> None:
    """Plan.save writes plain JSON that Plan.load reads back to an equal Plan."""
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text()) == plan.to_dict()
    assert Plan.load(path) == plan


def test_from_dict_accepts_shards_in_any_order() -> None:
    """The grid is rebuilt from the shard list whatever order the shards come in."""
    d = _plan().to_dict()
    for entry in d["tables"].values():
        entry["shards"].reverse()
    assert Plan.from_dict(d) == _plan()


def test_default_precision_is_fp32() -> None:
    """A table entry without "precision" loads as fp32 both ways."""
    d = _plan().to_dict()
    del _entry(d, "tw")["precision"]
    assert Plan.from_dict(d)["tw"].precision == WirePrecision("fp32", "fp32")


# ---- validate() refuses -----------------------------------------------------------------------


def _with(table: str, layout: TableLayout) -> Plan:
    return _plan().replace_table(table, layout)


VALIDATE_CASES = {
    "row gap at the end": ("uneven", TableLayout("ub", (0, 1, 400, 1000), (0, 16), ((3,), (3,), (6,)))),
    "row gap at the start": ("tw", TableLayout("rb", (1, 1000), (0, 32), ((5,),))),
    "column gap": ("cw", TableLayout("rb", (0, 500), (0, 12, 40, 60), ((2, 7, 0),))),
    "rows past the table": ("tw", TableLayout("rb", (0, 1001), (0, 32), ((5,),))),
    "overlapping rows": ("uneven", TableLayout("ub", (0, 500, 400, 1001), (0, 16), ((3,), (3,), (6,)))),
    "empty row slice": ("uneven", TableLayout("ub", (0, 400, 400, 1001), (0, 16), ((3,), (3,), (6,)))),
    "overlapping columns": ("cw", TableLayout("rb", (0, 500), (0, 40, 12, 64), ((2, 7, 0),))),
    "column bound not multiple of 4": ("cw", TableLayout("rb", (0, 500), (0, 10, 40, 64), ((2, 7, 0),))),
    "ranks grid too short": ("grid", TableLayout("rb", (0, 333, 334, 999), (0, 8, 24), ((1, 1), (4, 1)))),
    "one rank, two widths": ("grid", TableLayout("rb", (0, 333, 334, 999), (0, 8, 24), ((1, 1), (4, 3), (1, 3)))),
    "ranks grid ragged": ("grid", TableLayout("rb", (0, 333, 334, 999), (0, 8, 24), ((1, 1), (4,), (1, 4)))),
    "rank at world size": ("tw", TableLayout.table_wise(1000, 32, W)),
    "negative rank": ("grid", TableLayout("rb", (0, 333, 334, 999), (0, 8, 24), ((1, 1), (-1, 1), (1, 4)))),
    "unknown cluster": ("tw", TableLayout("xx", (0, 1000), (0, 32), ((5,),))),
    "dp with shards": ("dp", TableLayout("dp", (0, 100), (0, 16), ((0,),))),
    "single bound": ("tw", TableLayout("rb", (0,), (0, 32), ())),
}


@pytest.mark.parametrize("case", sorted(VALIDATE_CASES))
def test_validate_refuses_broken_layouts_naming_the_table(case: str) -> None:
    """Plan.validate raises a PlanError naming the table for gaps, overlaps, empty slices, column
    cuts off multiples of 4, a ranks grid that does not match the slices, ranks out of range,
    unknown clusters and DP tables with shards."""
    table, layout = VALIDATE_CASES[case]
    with pytest.raises(PlanError, match=f"table '{table}'"):
        _with(table, layout).validate(SPEC)


def test_validate_names_the_rank_out_of_range() -> None:
    """A rank outside the world is named in the error, with the world size."""
    with pytest.raises(PlanError, match=r"table 'tw'.*rank 8.*world size 8"):
        _with("tw", TableLayout.table_wise(1000, 32, 8)).validate(SPEC)


def test_validate_refuses_missing_and_extra_tables() -> None:
    """A plan without a layout for some table, or with a layout for a table the model lacks, is
    refused naming that table."""
    plan = _plan()
    missing = Plan(W, L, {k: v for k, v in plan.tables.items() if k != "cw"})
    with pytest.raises(PlanError, match="cw"):
        missing.validate(SPEC)
    extra = plan.replace_table("ghost", TableLayout.data_parallel())
    with pytest.raises(PlanError, match="ghost"):
        extra.validate(SPEC)


def test_validate_refuses_memory_over_the_cap_naming_the_rank() -> None:
    """With per-rank memory over the cap on one rank, validate names that rank; at or under the
    cap it passes."""
    plan = _plan()
    memory = CostModel(SPEC, Topology(W, L)).evaluate(plan).rank_memory
    worst = int(memory.argmax())
    second = sorted(memory)[-2]
    assert memory[worst] > second  # the case below has exactly one rank over
    cap = (memory[worst] + second) / 2
    with pytest.raises(PlanError, match=f"rank {worst} "):
        plan.validate(SPEC, memory, cap)
    plan.validate(SPEC, memory, float(memory.max()))
    # a synthetic memory vector: only rank 6 over
    fake = [1.0] * W
    fake[6] = 3e9
    with pytest.raises(PlanError, match="rank 6 "):
        plan.validate(SPEC, fake, 2e9)


# ---- from_dict refuses ------------------------------------------------------------------------


def _file() -> dict[str, Any]:
    return _plan().to_dict()


def test_from_dict_refuses_wrong_format_or_version() -> None:
    """A file with another format name, another version or no header is refused."""
    for key, value in (("format", "torchrec-plan"), ("version", 2), ("version", "1")):
        d = _file()
        d[key] = value
        with pytest.raises(PlanError, match="embark-plan"):
            Plan.from_dict(d)
    d = _file()
    del d["format"]
    with pytest.raises(PlanError):
        Plan.from_dict(d)


def _shards(table: str, shards: list[tuple[tuple[int, int], tuple[int, int], int]]) -> dict[str, Any]:
    d = _file()
    _entry(d, table)["shards"] = [{"rows": list(r), "cols": list(c), "rank": k} for r, c, k in shards]
    return d


FROM_DICT_CASES = {
    # two shards on the same cell
    "overlap same cell": ("uneven", [((0, 500), (0, 16), 1), ((0, 500), (0, 16), 2), ((500, 1001), (0, 16), 3)]),
    # a shard straddling another's row cut
    "overlap straddling": ("uneven", [((0, 600), (0, 16), 1), ((500, 1001), (0, 16), 2)]),
    # rows 400:500 uncovered
    "row gap inside": ("uneven", [((0, 400), (0, 16), 1), ((500, 1001), (0, 16), 2)]),
    # one column slice of row slice 1 missing
    "cell gap": ("grid", [((0, 333), (0, 8), 1), ((0, 333), (8, 24), 1), ((333, 999), (0, 8), 2)]),
    # a valid tiling that is not a grid: the lower half is cut into columns, the upper is not
    "not a grid": ("cw", [((0, 250), (0, 64), 0), ((250, 500), (0, 32), 1), ((250, 500), (32, 64), 2)]),
    "empty shard": ("tw", [((0, 1000), (0, 32), 5), ((1000, 1000), (0, 32), 6)]),
    "rank out of range": ("tw", [((0, 1000), (0, 32), 8)]),
    "negative rank": ("tw", [((0, 1000), (0, 32), -1)]),
    "rb without shards": ("tw", []),
    "dp with shards": ("dp", [((0, 100), (0, 16), 0)]),
}


@pytest.mark.parametrize("case", sorted(FROM_DICT_CASES))
def test_from_dict_refuses_broken_shard_lists_naming_the_table(case: str) -> None:
    """Plan.from_dict refuses overlapping shards, gaps inside the grid, shard lists that are not a
    grid, empty shards, ranks out of range and shard lists that contradict the cluster, with a
    PlanError naming the table."""
    table, shards = FROM_DICT_CASES[case]
    with pytest.raises(PlanError, match=f"table '{table}'"):
        Plan.from_dict(_shards(table, shards))


def test_from_dict_refuses_bad_cluster_and_precision() -> None:
    """Unknown clusters and precisions are refused naming the table."""
    d = _file()
    _entry(d, "tw")["cluster"] = "mp"
    with pytest.raises(PlanError, match="table 'tw'"):
        Plan.from_dict(d)
    d = _file()
    _entry(d, "cw")["precision"] = {"forward": "int4", "backward": "fp32"}
    with pytest.raises(PlanError, match="table 'cw'.*int4"):
        Plan.from_dict(d)


def test_loaded_edge_gaps_are_caught_by_validate() -> None:
    """A shard list that is a grid but misses the table's edge loads (the file has no table sizes)
    and is then refused by validate against the spec, naming the table."""
    d = _shards("uneven", [((0, 400), (0, 16), 1), ((400, 1000), (0, 16), 2)])
    plan = Plan.from_dict(d)
    with pytest.raises(PlanError, match="table 'uneven'"):
        plan.validate(SPEC)
    d = _shards("cw", [((0, 500), (4, 64), 1)])
    with pytest.raises(PlanError, match="table 'cw'"):
        Plan.from_dict(d).validate(SPEC)


def test_layout_edits_keep_the_tiling() -> None:
    """split_rows / split_cols / with_ranks produce layouts that still tile the table and put the new
    part on the given ranks."""
    lay = TableLayout.table_wise(1000, 32, 0)
    lay = lay.split_rows(0, 300, (1,))
    lay = lay.split_cols(0, 16, (2, 3))
    assert lay.row_bounds == (0, 300, 1000) and lay.col_bounds == (0, 16, 32)
    assert lay.ranks == ((0, 2), (1, 3))
    lay.validate("t", 1000, 32, 4)
    assert [s.rank for s in lay.shards()] == [0, 2, 1, 3]
    assert lay.with_ranks(((3, 3), (3, 3))).used_ranks() == {3}


def test_allreduce_precision_round_trips_and_is_checked() -> None:
    """DDP's all-reduce precision is written only when not fp32 (older files read as fp32), read back, and refused
    by name where DDP cannot run it."""
    plan = Plan(W, L, _plan().tables, {}, "bf16")
    d = plan.to_dict()
    assert d["allreduce_precision"] == "bf16" and Plan.from_dict(json.loads(json.dumps(d))) == plan
    assert "allreduce_precision" not in _plan().to_dict()
    with pytest.raises(PlanError, match="allreduce_precision"):
        Plan.from_dict({**d, "allreduce_precision": "fp8"})
    with pytest.raises(PlanError, match="allreduce_precision"):
        Plan(W, L, {}, {}, "fp8")


# ---- torchrec_at_fp8 --------------------------------------------------------------------------

FP8 = WirePrecision("fp8", "fp8")


def test_torchrec_at_fp8_round_trips_and_is_written_only_when_set() -> None:
    """A table-wise and a column-wise (slices of one width) fp8 layout keep torchrec_at_fp8 through the plan file;
    an unset flag is not written (so plan files of every other layout are unchanged)."""
    plan = _plan()
    plan = plan.replace_table("tw", replace(TableLayout.table_wise(1000, 32, 5), precision=FP8, torchrec_at_fp8=True))
    plan = plan.replace_table(
        "cw", TableLayout("rb", (0, 500), (0, 32, 64), ((2, 7),), WirePrecision("fp16", "fp8"), torchrec_at_fp8=True)
    )
    plan.validate(SPEC)
    d = json.loads(json.dumps(plan.to_dict()))
    assert _entry(d, "tw")["torchrec_at_fp8"] is True and _entry(d, "cw")["torchrec_at_fp8"] is True
    assert "torchrec_at_fp8" not in _entry(d, "grid")
    assert Plan.from_dict(d) == plan


TORCHREC_AT_FP8_REFUSED = {
    "tw at fp16": ("tw", replace(TableLayout.table_wise(1000, 32, 5), precision=WirePrecision("fp16", "fp16"))),
    "cw of two widths": ("cw", TableLayout("rb", (0, 500), (0, 12, 40, 64), ((2, 7, 0),), FP8)),
    "row-wise": ("twrw", TableLayout("rb", (0, 1000, 2000, 3000, 4000), (0, 8), ((4,), (5,), (6,), (7,)), FP8)),
    "unique-based": ("uneven", TableLayout("ub", (0, 1001), (0, 16), ((3,),), FP8)),
}


@pytest.mark.parametrize("case", sorted(TORCHREC_AT_FP8_REFUSED))
def test_torchrec_at_fp8_is_refused_where_torchrec_cannot_run_the_layout_at_fp8(case: str) -> None:
    """torchrec_at_fp8 on a layout TorchRec's sharding cannot run at fp8 in a group of one row width (not fp8, column
    slices of two widths, row slices, another cluster kind) is refused naming the table and the field, from a plan
    file and by validate; on a dp table too."""
    table, layout = TORCHREC_AT_FP8_REFUSED[case]
    d = _plan().to_dict()
    d["tables"][table] = {**_with(table, layout).to_dict()["tables"][table], "torchrec_at_fp8": True}
    with pytest.raises(PlanError, match=f"table '{table}'.*torchrec_at_fp8"):
        Plan.from_dict(d)
    with pytest.raises(PlanError, match=f"table '{table}'.*torchrec_at_fp8"):
        _with(table, replace(layout, torchrec_at_fp8=True)).validate(SPEC)
    d["tables"]["dp"]["torchrec_at_fp8"] = True
    d["tables"][table] = _plan().to_dict()["tables"][table]
    with pytest.raises(PlanError, match="table 'dp'.*torchrec_at_fp8"):
        Plan.from_dict(d)


def test_a_split_drops_torchrec_at_fp8() -> None:
    """Cutting a layout's rows or columns makes another layout: it runs on ours unless the planner chooses again."""
    tw = replace(TableLayout.table_wise(1000, 32, 5), precision=FP8, torchrec_at_fp8=True)
    assert not tw.split_rows(0, 500, (6,)).torchrec_at_fp8
    assert not tw.split_cols(0, 16, (6,)).torchrec_at_fp8
    assert tw.with_ranks(((6,),)).torchrec_at_fp8


def test_torchrec_at_fp8_on_a_sequence_table_must_be_table_wise() -> None:
    """TorchRec's EmbeddingCollection runs no column-wise sharding: a sequence table's column-wise fp8 layout with
    torchrec_at_fp8 is refused naming the table and the field, from a plan file and by validate against the model;
    its table-wise one is kept."""
    cw = TableLayout("rb", (0, 500), (0, 32, 64), ((2, 7),), FP8, torchrec_at_fp8=True)
    tw = replace(TableLayout.table_wise(500, 64, 2), precision=FP8, torchrec_at_fp8=True)
    spec = ModelSpec("m", 64, (TableSpec("s", 500, 64, 2.0, kind="sequence"),))
    for layout, refused in ((cw, True), (tw, False)):
        plan = Plan(W, L, {"s": layout}).with_kinds(spec)
        d = plan.to_dict()
        if refused:
            with pytest.raises(PlanError, match="table 's'.*torchrec_at_fp8.*table-wise"):
                Plan.from_dict(d)
            with pytest.raises(PlanError, match="table 's'.*torchrec_at_fp8.*table-wise"):
                plan.validate(spec)
        else:
            assert Plan.from_dict(d) == plan
            plan.validate(spec)
