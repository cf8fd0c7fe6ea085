"""Property tests: random model specs and topologies; every plan the search makes keeps the invariants."""

from __future__ import annotations

import re

import numpy as np
import pytest

from embark_torchrec.plan.layout.tables import Plan, PlanError
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.search.config import SearchConfig
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import PRESETS, Topology

CASES = 40
# The invariants hold move by move, whatever the climb's budget: a quarter of the default budget still takes
# every kind of move on these small models (their climbs reach a local optimum and sweep within it) at a quarter
# of the time, for 40 cases planned twice.
CONFIG = SearchConfig(improve_evaluations=SearchConfig().improve_evaluations // 4)


def _random_case(seed: int) -> tuple[ModelSpec, Topology]:
    rng = np.random.default_rng(seed)
    world = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
    local = int(rng.choice([d for d in (1, 2, 4, 8) if world % d == 0]))
    tables = []
    for i in range(int(rng.integers(1, 40))):
        dist = IdDistribution("zipf", float(rng.uniform(0.6, 1.4))) if rng.random() < 0.5 else None
        tables.append(
            TableSpec(
                name=f"t{i}",
                rows=int(10 ** rng.uniform(0.5, 7.5)),
                dim=int(4 * rng.integers(1, 65)),
                pooling=float(rng.choice([0.5, 1, 3, 20, 100])),
                feature_names=tuple(f"t{i}_f{j}" for j in range(int(rng.integers(1, 3)))),
                id_distribution=dist,
                unique_ratio=float(rng.uniform(0.05, 1.0)) if rng.random() < 0.2 else None,
            )
        )
    spec = ModelSpec(f"random{seed}", world * int(rng.integers(1, 512)), tuple(tables), IdDistribution())
    total = sum(t.rows * t.dim * 4 for t in tables)
    # memory from roomy down to about twice what the tables need, so some cases must split tables
    hbm_gb = max(total * float(rng.uniform(2.0, 8.0)) / world / 1e9, 0.001) + PRESETS["dgx-h100"].hbm_reserve_gb
    hardware = PRESETS["dgx-h100"].with_overrides(hbm_gb=min(hbm_gb, 80.0))
    return spec, Topology(world, local, hardware)


def _coverage(shards: list[dict], rows: int, dim: int) -> np.ndarray:
    """How many shards cover each elementary rectangle of the table (cut at every shard bound), from the plan
    file's shard list alone, independent of how the layout built it."""
    row_cuts = sorted({0, rows, *(b for s in shards for b in s["rows"])})
    col_cuts = sorted({0, dim, *(b for s in shards for b in s["cols"])})
    counts = np.zeros((len(row_cuts) - 1, len(col_cuts) - 1), dtype=np.int64)
    for s in shards:
        r0, r1 = (row_cuts.index(b) for b in s["rows"])
        c0, c1 = (col_cuts.index(b) for b in s["cols"])
        counts[r0:r1, c0:c1] += 1
    return counts


@pytest.mark.parametrize("seed", range(CASES))
def test_random_plans_keep_the_invariants(seed: int) -> None:
    """Each table tiled exactly once, checked on the plan file's shard list (every elementary rectangle covered by
    exactly one shard, nothing outside the table), ranks in range, memory within the cap, columns cut on multiples of
    4, and the same inputs give the same plan."""
    spec, topology = _random_case(seed)
    planned = plan_model(spec, topology, config=CONFIG)
    plan = planned.plan
    tables = plan.to_dict()["tables"]
    assert set(tables) == {t.name for t in spec.tables}
    for t in spec.tables:
        shards = tables[t.name]["shards"]
        if tables[t.name]["cluster"] == "dp":
            assert shards == []
            continue
        for shard in shards:
            assert 0 <= shard["rank"] < topology.world_size
            assert shard["cols"][0] % 4 == 0 and shard["cols"][1] % 4 == 0
            assert (
                0 <= shard["rows"][0] < shard["rows"][1] <= t.rows and 0 <= shard["cols"][0] < shard["cols"][1] <= t.dim
            )
        assert (_coverage(shards, t.rows, t.dim) == 1).all(), t.name
    assert float(planned.cost.rank_memory.max()) <= topology.hbm_cap_bytes
    assert plan_model(spec, topology, config=CONFIG).plan.to_dict() == plan.to_dict()


@pytest.mark.parametrize(
    "shards",
    [
        [{"rows": [0, 60], "cols": [0, 8], "rank": 0}, {"rows": [40, 100], "cols": [0, 8], "rank": 1}],  # rows overlap
        [{"rows": [0, 100], "cols": [0, 8], "rank": 0}, {"rows": [0, 100], "cols": [4, 8], "rank": 1}],  # cols overlap
        [{"rows": [0, 100], "cols": [0, 8], "rank": 0}, {"rows": [0, 100], "cols": [0, 8], "rank": 1}],  # a cell twice
        [{"rows": [0, 40], "cols": [0, 8], "rank": 0}, {"rows": [50, 100], "cols": [0, 8], "rank": 1}],  # a gap
        [{"rows": [0, 100], "cols": [0, 4], "rank": 0}],  # columns missing
    ],
)
def test_plan_files_that_do_not_tile_are_refused(shards: list[dict]) -> None:
    """A hand-written plan file whose shards overlap (also partly), leave a gap or miss columns is refused."""
    assert not (_coverage(shards, 100, 8) == 1).all()  # the independent check agrees it does not tile
    data = {
        "format": "embark-plan", "version": 1, "world_size": 2, "local_world_size": 2,
        "tables": {"t": {"cluster": "rb", "precision": {"forward": "fp32", "backward": "fp32"}, "shards": shards}},
    }  # fmt: skip
    with pytest.raises(PlanError, match="table 't'"):
        Plan.from_dict(data).validate(ModelSpec("m", 8, (TableSpec("t", 100, 8, 1.0),)))


def test_a_model_that_cannot_fit_names_the_tables() -> None:
    """Memory for less than the tables need: a PlanError that names the tables that do not fit."""
    spec = ModelSpec("big", 64, (TableSpec("huge", 50_000_000, 128, 1.0), TableSpec("small", 1000, 16, 1.0)))
    hardware = PRESETS["dgx-h100"].with_overrides(hbm_gb=PRESETS["dgx-h100"].hbm_reserve_gb + 1.0)
    with pytest.raises(PlanError, match=re.escape("tables ['huge'] do not fit")):
        plan_model(spec, Topology(8, 8, hardware))
