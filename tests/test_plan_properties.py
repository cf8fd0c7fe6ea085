"""Property tests: random model specs and topologies; every plan the search makes keeps the invariants."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from embark_torchrec.plan.layout import PlanError
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.spec import IdDistribution, ModelSpec, TableSpec
from embark_torchrec.plan.topology import PRESETS, Topology

CASES = 40


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


@pytest.mark.parametrize("seed", range(CASES))
def test_random_plans_keep_the_invariants(seed: int) -> None:
    """Each table tiled exactly once (counted cell by cell), ranks in range, memory within the cap,
    columns cut on multiples of 4, and the same inputs give the same plan."""
    spec, topology = _random_case(seed)
    planned = plan_model(spec, topology)
    plan = planned.plan
    assert set(plan.tables) == {t.name for t in spec.tables}
    for t in spec.tables:
        layout = plan[t.name]
        if layout.cluster == "dp":
            continue
        covered: Counter[tuple[int, int]] = Counter()
        for shard in layout.shards():
            assert 0 <= shard.rank < topology.world_size
            assert shard.cols[0] % 4 == 0 and shard.cols[1] % 4 == 0
            covered[(shard.rows, shard.cols)] += 1
        area = sum((r[1] - r[0]) * (c[1] - c[0]) for (r, c) in covered)
        assert area == t.rows * t.dim, t.name
        assert max(covered.values()) == 1, t.name
    assert float(planned.cost.rank_memory.max()) <= topology.hbm_cap_bytes
    assert plan_model(spec, topology).plan.to_dict() == plan.to_dict()


def test_a_model_that_cannot_fit_names_the_tables() -> None:
    """Memory for less than the tables need: a PlanError that names the tables that do not fit."""
    spec = ModelSpec("big", 64, (TableSpec("huge", 50_000_000, 128, 1.0), TableSpec("small", 1000, 16, 1.0)))
    hardware = PRESETS["dgx-h100"].with_overrides(hbm_gb=PRESETS["dgx-h100"].hbm_reserve_gb + 1.0)
    with pytest.raises(PlanError, match=re.escape("tables ['huge'] do not fit")):
        plan_model(spec, Topology(8, 8, hardware))
