"""A cluster kind is one registered class: a toy kind, written here and registered for the test's duration, is read
from plan files, named in sharding-type strings, counted in collectives, priced, listed message by message, planned
by EmbarkPlanner's search and the lower bound, and trained inside DMP equal to an unsharded model, with no edit
anywhere else. And the built-in kinds are the only place the library branches on a kind's name."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.cost.bound import step_lower_bound
from embark_torchrec.plan.layout.kinds import (
    ReductionKind,
    cluster_kind,
    cluster_kind_names,
    register_cluster_kind,
    unregister_cluster_kind,
)
from embark_torchrec.plan.layout.constraints import TableConstraints
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.groups import ShardingGroup, sharding_group
from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import PRESETS, Topology
from embark_torchrec.plan.layout.torchrec_types import FLAT_COLLECTIVES, HIERARCHICAL_COLLECTIVES
from embark_torchrec.plan.cost.traffic import table_messages
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import compare_sharded_training

ROOT = Path(__file__).resolve().parents[2] / "embark_torchrec"


class ToyKind(ReductionKind):
    """Reduction-based, but never on TorchRec's types: even a table-wise layout runs on our grid dists."""

    name = "toy"

    def builtin_sharding_type(self, layout: TableLayout, rows: int, world_size: int, local_world_size: int) -> None:
        return None


@pytest.fixture
def toy() -> Iterator[ToyKind]:
    kind = ToyKind()
    register_cluster_kind(kind)
    yield kind
    unregister_cluster_kind(kind.name)


def _toy_grid(hierarchical: bool = False) -> TableLayout:
    return TableLayout("toy", (0, 30, 64), (0, 8, 16), ((0, 1), (2, 3)), hierarchical=hierarchical)


def test_a_toy_kind_is_read_from_plan_files_and_named_in_sharding_types(toy: ToyKind) -> None:
    plan = Plan(4, 2, {"t": TableLayout.table_wise(64, 16, 1, "toy"), "g": _toy_grid(hierarchical=True)})
    again = Plan.from_dict(plan.to_dict())
    assert again == plan and again["t"].kind is toy
    assert sharding_group(plan["t"], 64, 4, 2).name == "embark_toy"  # RB would run it as "table_wise"
    assert sharding_group(TableLayout.table_wise(64, 16, 1), 64, 4, 2).name == "table_wise"
    assert sharding_group(plan["g"], 64, 4, 2).name == "embark_toy_hier"
    assert ShardingGroup.parse("embark_toy").collectives_per_step == FLAT_COLLECTIVES
    assert ShardingGroup.parse("embark_toy_hier").collectives_per_step == HIERARCHICAL_COLLECTIVES


def test_an_unregistered_kind_is_refused_naming_the_table_and_the_known_kinds() -> None:
    entry = {"cluster": "toy", "shards": [{"rows": [0, 64], "cols": [0, 16], "rank": 0}]}
    document = {"format": "embark-plan", "version": 1, "world_size": 2, "local_world_size": 1, "tables": {"t": entry}}
    with pytest.raises(PlanError, match="table 't'.*cluster.*'dp', 'rb', 'ub'"):
        Plan.from_dict(document)
    with pytest.raises(ValueError, match="already registered"):
        register_cluster_kind(ReductionKind())
    for bad in ("rb_x", "rb:x", "rb@x"):
        with pytest.raises(ValueError, match="without '_', ':' or '@'"):
            register_cluster_kind(type("Bad", (ReductionKind,), {"name": bad})())


def _cost(world_size: int = 4, local_world_size: int = 2) -> CostModel:
    spec = ModelSpec("toy", 256, (TableSpec("t", 64, 16, 3.0, ("f",)),))
    return CostModel(spec, Topology(world_size, local_world_size, PRESETS["dgx-h100"]))


@pytest.mark.parametrize("hierarchical", [False, True])
def test_a_toy_kind_prices_and_sends_what_its_base_kind_does(toy: ToyKind, hierarchical: bool) -> None:
    """Its grid runs as ours either way, so its load equals RB's on the same grid, and its messages RB's."""
    cost = _cost()
    grid = _toy_grid(hierarchical)
    as_rb = TableLayout("rb", grid.row_bounds, grid.col_bounds, grid.ranks, hierarchical=hierarchical)
    toy_load, rb_load = cost.table_load("t", grid), cost.table_load("t", as_rb)
    np.testing.assert_array_equal(toy_load.rows, rb_load.rows)
    assert set(toy_load.groups) == {ShardingGroup("pooled", "toy", hierarchical)}
    assert table_messages(cost, "t", grid) == table_messages(cost, "t", as_rb)
    sent = sum(m.nbytes for m in table_messages(cost, "t", grid))
    assert sent == pytest.approx(float((toy_load.send_intra + toy_load.send_inter).sum()))


def test_the_planner_and_the_bound_take_a_table_forced_to_a_toy_kind(toy: ToyKind) -> None:
    spec = ModelSpec(
        "toy-model",
        4096,
        (TableSpec("t", 50_000, 64, 20.0, ("f",)), TableSpec("u", 2_000, 32, 2.0, ("g",))),
    )
    topology = Topology(8, 4, PRESETS["dgx-h100"])
    constraints = {"t": TableConstraints(cluster="toy")}
    planned = plan_model(spec, topology, constraints=constraints, progress=False)
    assert planned.plan["t"].cluster == "toy" and planned.plan["u"].cluster != "toy"
    groups = CostModel(spec, topology).rank_load(planned.plan).groups
    assert any(group.runner == "toy" for group in groups)
    assert 0.0 < step_lower_bound(CostModel(spec, topology), constraints) <= planned.cost.step_ms


def _train_toy() -> dict[str, float]:
    """On each rank: the toy kind registered there too (a spawned rank imports this module afresh), then training
    sharded by a toy table-wise table and a toy 2 x 2 hierarchical grid beside an RB one, against unsharded."""
    register_cluster_kind(ToyKind())
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=64, embedding_dim=16, feature_names=[f"f_{n}"])
        for n in ("t", "g", "r")
    ]
    layouts = {
        "t": TableLayout.table_wise(64, 16, 1, "toy"),
        "g": TableLayout("toy", (0, 30, 64), (0, 8, 16), ((0, 1), (1, 0)), hierarchical=True),
        "r": TableLayout("rb", (0, 20, 64), (0, 16), ((1,), (0,))),
    }
    return compare_sharded_training(tables, layouts, local_world_size=1, optimizer="adagrad")


def test_a_toy_kind_trains_in_dmp_exactly_like_an_unsharded_model() -> None:
    for diffs in run_ranks(_train_toy, world_size=2, local_world_size=1):
        assert diffs and max(diffs.values()) < 1e-5, diffs


_BRANCH = re.compile(
    r"""(==|!=)\s*["'](dp|rb|ub)["']|["'](dp|rb|ub)["']\s*(==|!=|in\b)|\bin\s*[(\[{]\s*["'](dp|rb|ub)["']"""
)


def test_no_module_but_the_registry_branches_on_a_cluster_kind_name() -> None:
    registry = {ROOT / "plan" / "layout" / "kinds.py"}
    branches = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in sorted(ROOT.rglob("*.py"))
        if path not in registry
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _BRANCH.search(line)
    ]
    assert branches == []
    assert cluster_kind_names()[:3] == ("dp", "rb", "ub") and cluster_kind("dp").replicated
