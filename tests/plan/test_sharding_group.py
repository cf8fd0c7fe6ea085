"""ShardingGroup: the value a sharding group is, and its TorchRec sharding-type string.

Every group the registry can make (each module, every TorchRec type the planner prices and every registered cluster
kind of ours, flat and hierarchical where the kind reduces, at every wire precision and, for TorchRec's types at a
row-scaled one, a row width) parses back from its name to itself; the names keep the grammar TorchRec's plans already
carry; and a string no group names is refused.
"""

from __future__ import annotations

import itertools

import pytest

from embark_torchrec.plan.layout.groups import ShardingGroup, sharding_group
from embark_torchrec.plan.layout.kinds import cluster_kind, cluster_kind_names
from embark_torchrec.plan.layout.tables import PRECISIONS, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.layout.torchrec_types import BUILTIN_COLLECTIVES, DATA_PARALLEL
from embark_torchrec.plan.layout.wire import EMBARK_ID_BYTES, ROW_SCALED_PRECISIONS, TORCHREC_ID_BYTES
from embark_torchrec.plan.model.fields import TABLE_KINDS

WIDTH = 64


def _every_group() -> list[ShardingGroup]:
    wires = [WirePrecision(f, b) for f, b in itertools.product(PRECISIONS, PRECISIONS)]
    groups = []
    for module in TABLE_KINDS:
        groups.append(ShardingGroup(module, DATA_PARALLEL))
        for runner, precision in itertools.product(sorted(set(BUILTIN_COLLECTIVES) - {DATA_PARALLEL}), wires):
            scaled = {precision.forward, precision.backward} & ROW_SCALED_PRECISIONS
            groups.append(ShardingGroup(module, runner, precision=precision, row_width=WIDTH if scaled else 0))
        for name in cluster_kind_names():
            kind = cluster_kind(name)
            if kind.replicated:
                continue
            for hierarchical, precision in itertools.product(kind.hierarchy_options(2), wires):
                groups.append(ShardingGroup(module, name, hierarchical, precision))
    return groups


EVERY_GROUP = _every_group()


@pytest.mark.parametrize("group", EVERY_GROUP, ids=lambda g: f"{g.module}-{g.name}")
def test_every_group_round_trips_through_its_name(group: ShardingGroup) -> None:
    """parse(name) gives back the same value, and only TorchRec's types run TorchRec's dists (int64 IDs)."""
    assert ShardingGroup.parse(group.name, group.module) == group
    ours = group.name.startswith("embark_")
    assert (group.torchrec_type is None) == ours
    assert group.id_bytes == (EMBARK_ID_BYTES if ours else TORCHREC_ID_BYTES)
    assert group.collectives_per_step > 0


def test_the_registry_makes_groups_of_every_sort() -> None:
    """The round trip covers hierarchical groups of ours, row widths and both modules (so it can fail on each)."""
    assert any(g.hierarchical for g in EVERY_GROUP)
    assert any(g.row_width for g in EVERY_GROUP)
    assert {g.module for g in EVERY_GROUP} == set(TABLE_KINDS)
    assert len(set(EVERY_GROUP)) == len(EVERY_GROUP)


@pytest.mark.parametrize(
    "name",
    [
        "table_wise",
        "data_parallel",
        "table_wise:fp16-fp16",
        "row_wise:fp16-bf16",
        "table_wise:fp8-fp8@64",
        "column_wise:fp16-fp8@12",
        "embark_rb",
        "embark_rb_hier:fp8-fp32",
        "embark_ub:fp16-bf16",
    ],
)
def test_names_keep_the_strings_torchrec_plans_carry(name: str) -> None:
    """The strings in ShardingPlans written before the value existed read back and are written byte for byte."""
    assert ShardingGroup.parse(name).name == name


def test_a_layout_runs_in_its_group() -> None:
    """sharding_group: a table-wise layout at fp8 whose torchrec_at_fp8 is set runs on TorchRec's type in the group
    of its width; the same layout of a sequence table is another module's group; a hierarchical grid of ours runs
    flat in an EmbeddingCollection."""
    fp8 = WirePrecision("fp8", "fp8")
    layout = TableLayout("rb", (0, 100), (0, 32), ((1,),), fp8, torchrec_at_fp8=True)
    pooled = sharding_group(layout, 100, 4, 2)
    assert pooled == ShardingGroup("pooled", "table_wise", False, fp8, 32)
    assert pooled.name == "table_wise:fp8-fp8@32"
    sequence = sharding_group(layout, 100, 4, 2, sequence=True)
    assert sequence.name == pooled.name and sequence != pooled
    grid = TableLayout("rb", (0, 50, 100), (0, 16, 32), ((0, 1), (2, 3)), hierarchical=True)
    assert sharding_group(grid, 100, 4, 2).name == "embark_rb_hier"
    assert sharding_group(grid, 100, 4, 2, sequence=True).name == "embark_rb"


@pytest.mark.parametrize(
    "name,match",
    [
        ("table_wise@x", "not a whole number"),
        ("table_wise:fp8-fp8", "row width"),
        ("table_wise:fp16-fp16@64", "row width"),
        ("embark_rb:fp8-fp8@64", "takes no row width"),
        ("embark_dp", "unknown embark sharding type"),
        ("embark_rb_flat", "unknown embark sharding type"),
        ("embark_nosuchkind", "unknown embark sharding type"),
        ("table_wise:fp64-fp64", "fp64"),
    ],
)
def test_a_string_no_group_names_is_refused(name: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        ShardingGroup.parse(name)


def test_an_unpriced_torchrec_type_parses_but_is_not_priced() -> None:
    """TorchRec's own planner may choose a type the planner does not price (grid_shard): from_sharding_plan reads it,
    pricing it says so."""
    group = ShardingGroup.parse("grid_shard")
    assert group.torchrec_type == "grid_shard" and group.name == "grid_shard"
    with pytest.raises(PlanError, match="grid_shard"):
        group.collectives_per_step
