"""The EMBark search end to end (plan_model) and the cluster assignment: exact tiling, memory
caps, determinism, constraints, quality against the table-row-wise baseline, and failures."""

from __future__ import annotations

import itertools
from collections import Counter
from functools import lru_cache

import numpy as np
import pytest

from embark_torchrec.plan.search.baselines import table_row_wise_plan
from embark_torchrec.plan.search.clusters import assign_clusters, mean_rank_ms
from embark_torchrec.plan.layout.constraints import TableConstraints
from embark_torchrec.plan.cost.model import CostModel, OptimizerMemory
from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.plan_model import PlannedModel, plan_model
from embark_torchrec.plan.search.config import SearchConfig
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec, builtin_model
from embark_torchrec.plan.model.topology import PRESETS, Topology
from tests.support.specs import HOT, HUGE, MID, WIDE, with_memory


def mixed_spec() -> ModelSpec:
    return ModelSpec(
        "mixed",
        8192,
        (
            HUGE,
            WIDE,
            MID,
            HOT,
            TableSpec("tiny1", 10, 16, 1.0),
            TableSpec("tiny2", 100, 8, 2.0),
            TableSpec("odd", 12_345, 20, 3.0, unique_ratio=0.1),
            TableSpec("uni", 30_000, 36, 2.0, id_distribution=IdDistribution("uniform")),
        ),
        IdDistribution("zipf", 1.1),
    )


# (name, world, local, hbm_gb): the 0.2 GB cases only fit when the biggest tables are split
SYNTHETIC = [
    ("w1", 1, 1, 80.0),
    ("w4", 4, 2, 80.0),
    ("w8", 8, 4, 80.0),
    ("w4-tight", 4, 2, 0.2),
    ("w8-tight", 8, 4, 0.1),
]
DCNV2 = [("dcnv2-8", 8, 8), ("dcnv2-16", 16, 8)]


@lru_cache(maxsize=None)
def _synthetic(case: str) -> PlannedModel:
    _, w, lws, gb = next(c for c in SYNTHETIC if c[0] == case)
    return plan_model(mixed_spec(), Topology(w, lws, with_memory(gb)))


@lru_cache(maxsize=None)
def _dcnv2(world: int) -> PlannedModel:
    return plan_model(builtin_model("dcnv2"), Topology(world, 8))


def _planned(case: str) -> PlannedModel:
    if case.startswith("dcnv2"):
        return _dcnv2(int(case.split("-")[1]))
    return _synthetic(case)


ALL_CASES = [c[0] for c in SYNTHETIC] + [c[0] for c in DCNV2]


# ---- independent checks (from the plan file, not from the code under test) ---------------------


def check_tiling(spec: ModelSpec, plan: Plan) -> None:
    """Every table of the spec appears once; every non-DP table's shards (as written in the plan
    file) cover each cell of rows x dim exactly once, on ranks in range, columns on multiples of 4."""
    d = plan.to_dict()
    assert sorted(d["tables"]) == sorted(t.name for t in spec.tables)
    for t in spec.tables:
        entry = d["tables"][t.name]
        shards = entry["shards"]
        if entry["cluster"] == "dp":
            assert shards == []
            continue
        assert entry["cluster"] in ("rb", "ub")
        assert shards, t.name
        row_cuts = sorted({b for s in shards for b in s["rows"]})
        col_cuts = sorted({b for s in shards for b in s["cols"]})
        assert row_cuts[0] == 0 and row_cuts[-1] == t.rows, (t.name, row_cuts)
        assert col_cuts[0] == 0 and col_cuts[-1] == t.dim, (t.name, col_cuts)
        assert all(c % 4 == 0 for c in col_cuts), (t.name, col_cuts)
        counter: Counter[tuple[int, int]] = Counter()
        for s in shards:
            assert 0 <= s["rank"] < plan.world_size, (t.name, s)
            (r0, r1), (c0, c1) = s["rows"], s["cols"]
            assert r0 < r1 and c0 < c1, (t.name, s)
            for i in range(row_cuts.index(r0), row_cuts.index(r1)):
                for j in range(col_cuts.index(c0), col_cuts.index(c1)):
                    counter[(i, j)] += 1
        cells = {(i, j) for i in range(len(row_cuts) - 1) for j in range(len(col_cuts) - 1)}
        assert set(counter) == cells, (t.name, sorted(cells - set(counter)))
        assert set(counter.values()) == {1}, (t.name, [k for k, v in counter.items() if v != 1])
        if t.rows * t.dim <= 4_000_000:  # element by element as well
            grid = np.zeros((t.rows, t.dim), dtype=np.int8)
            for s in shards:
                (r0, r1), (c0, c1) = s["rows"], s["cols"]
                grid[r0:r1, c0:c1] += 1
            assert (grid == 1).all(), t.name


def memory_per_rank(spec: ModelSpec, plan: Plan, optimizer: OptimizerMemory = OptimizerMemory()) -> np.ndarray:
    """fp32 weights + optimizer state per rank, from the shards (DP tables in full on every rank)."""
    mem = np.zeros(plan.world_size)
    per_row = lambda width: width * (4 + optimizer.bytes_per_element) + optimizer.bytes_per_row  # noqa: E731
    for t in spec.tables:
        layout = plan[t.name]
        if layout.cluster == "dp":
            mem += t.rows * per_row(t.dim)
        for s in layout.shards():
            mem[s.rank] += (s.rows[1] - s.rows[0]) * per_row(s.cols[1] - s.cols[0])
    return mem


# ---- properties of every plan ----------------------------------------------------------------


@pytest.mark.parametrize("case", ALL_CASES)
def test_every_table_tiled_exactly_once(case: str) -> None:
    """The plan passes validate and, checked independently cell by cell, tiles every table exactly once."""
    planned = _planned(case)
    planned.plan.validate(planned.spec)
    check_tiling(planned.spec, planned.plan)
    assert list(planned.plan.tables) == [t.name for t in planned.spec.tables]
    assert (planned.plan.world_size, planned.plan.local_world_size) == (
        planned.topology.world_size,
        planned.topology.local_world_size,
    )


@pytest.mark.parametrize("case", ALL_CASES)
def test_memory_per_rank_within_cap(case: str) -> None:
    """Every rank's embedding memory (recounted from the shards) is within topology.hbm_cap_bytes,
    and the cost model's per-rank memory agrees with the recount."""
    planned = _planned(case)
    mem = memory_per_rank(planned.spec, planned.plan)
    assert mem.max() <= planned.topology.hbm_cap_bytes
    np.testing.assert_allclose(planned.cost.rank_memory, mem, rtol=1e-9)


def test_tight_memory_forces_splits() -> None:
    """In the tight cases the biggest table alone is over one rank's cap, so the plan must have
    split it; the memory check above is therefore not vacuous."""
    for case in ("w4-tight", "w8-tight"):
        planned = _synthetic(case)
        huge = planned.spec.table("huge")
        assert huge.rows * (huge.dim * 4 + 4) > planned.topology.hbm_cap_bytes
        layout = planned.plan["huge"]
        assert layout.num_row_slices * layout.num_col_slices >= 2
        assert len(layout.used_ranks()) >= 2


@pytest.mark.parametrize("case", ["w4-tight", "w8", "dcnv2-16"])
def test_plans_are_deterministic(case: str) -> None:
    """Planning the same spec on the same topology twice gives identical plan files (and clusters)."""
    first = _planned(case)
    again = plan_model(first.spec, first.topology)
    assert again.plan.to_dict() == first.plan.to_dict()
    assert again.clusters == first.clusters
    assert again.cost.step_ms == first.cost.step_ms


_SUBPROCESS_PLAN = """
import json, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from test_plan_search import SYNTHETIC, _synthetic
print(json.dumps(_synthetic("w4-tight").plan.to_dict(), sort_keys=True))
"""


def test_plans_are_deterministic_across_processes() -> None:
    """Two fresh interpreters with different string-hash seeds write the same plan file as this one
    (no dependence on set or dict iteration order)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    code = _SUBPROCESS_PLAN.format(root=str(tests.parents[1]), tests=str(tests))
    expected = json.dumps(_synthetic("w4-tight").plan.to_dict(), sort_keys=True)
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


@pytest.mark.parametrize("world", [8, 16])
def test_embark_beats_table_row_wise_on_dcnv2(world: int) -> None:
    """On dcnv2 (nodes of 8) EMBark's estimated step time is no worse than the table-row-wise
    baseline's under the same CostModel, and the estimate is what the CostModel says of the plan."""
    planned = _dcnv2(world)
    cost = CostModel(planned.spec, planned.topology)
    trw = table_row_wise_plan(planned.spec, planned.topology)
    trw.validate(planned.spec)
    embark_ms = cost.evaluate(planned.plan).step_ms
    assert embark_ms == pytest.approx(planned.cost.step_ms, rel=1e-12)
    assert embark_ms <= cost.evaluate(trw).step_ms


BRUTE_FORCE_CASES = 30
BRUTE_FORCE_TOLERANCE = 1.05  # the greedy search is a heuristic: within 5% of the exhaustive optimum


def _brute_force_ms(spec: ModelSpec, topology: Topology) -> float:
    """The best estimated step over every assignment of each table to data-parallel or one whole rank."""
    cost = CostModel(spec, topology)
    ws = topology.world_size
    best = float("inf")
    for choice in itertools.product(["dp", *range(ws)], repeat=len(spec.tables)):
        layouts = {
            t.name: TableLayout.data_parallel() if c == "dp" else TableLayout.table_wise(t.rows, t.dim, int(c))
            for t, c in zip(spec.tables, choice)
        }
        best = min(best, cost.evaluate(Plan(ws, topology.local_world_size, layouts)).step_ms)
    return best


@pytest.mark.parametrize("seed", range(BRUTE_FORCE_CASES))
def test_search_is_near_an_exhaustive_search_on_tiny_models(seed: int) -> None:
    """On tiny models (2-4 tables, 2 ranks) the search's plan is within 5% of the best of every data-parallel /
    table-wise assignment, found by exhaustive enumeration independent of the search (it may do better, with
    grids or UB)."""
    rng = np.random.default_rng(seed)
    tables = tuple(
        TableSpec(
            f"t{i}",
            int(rng.choice([100, 5_000, 200_000, 2_000_000])),
            int(rng.choice([16, 64, 128])),
            float(rng.choice([1, 5, 30])),
        )
        for i in range(int(rng.integers(2, 5)))
    )
    spec = ModelSpec("tiny", 4096, tables, IdDistribution("zipf", 1.1))
    topology = Topology(2, 2, PRESETS["dgx-h100" if seed % 2 else "cpu-gloo"])
    assert plan_model(spec, topology).cost.step_ms <= _brute_force_ms(spec, topology) * BRUTE_FORCE_TOLERANCE


# ---- constraints ------------------------------------------------------------------------------


FORCED_LAYOUT = TableLayout(
    "rb", (0, 70_000, 200_000), (0, 128, 256), ((7, 6), (5, 7)), WirePrecision("fp16", "bf16"), hierarchical=True
)


def _constraints() -> dict[str, TableConstraints]:
    return {
        "tiny1": TableConstraints(cluster="rb"),  # would be DP unconstrained
        "huge": TableConstraints(cluster="rb"),
        "mid": TableConstraints(cluster="ub"),
        "wide": TableConstraints(layout=FORCED_LAYOUT),
        "hot": TableConstraints(ranks=(1, 3, 6)),
        "odd": TableConstraints(ranks=(5,), precision=WirePrecision("bf16", "bf16")),
        "uni": TableConstraints(cluster="rb", ranks=(0, 2, 4, 6)),
    }


@lru_cache(maxsize=None)
def _constrained() -> PlannedModel:
    return plan_model(mixed_spec(), Topology(8, 4, with_memory(0.3)), _constraints())


def test_unconstrained_choices_differ_from_the_forced_ones() -> None:
    """Without constraints the search would choose otherwise (so the next test checks something)."""
    free = plan_model(mixed_spec(), Topology(8, 4, with_memory(0.3)))
    assert free.clusters["tiny1"] == "dp"
    assert free.clusters["huge"] != "rb"
    assert free.clusters["mid"] != "ub"
    assert free.plan["wide"] != FORCED_LAYOUT
    hot = free.plan["hot"]  # data-parallel is a choice ranks constraints rule out too
    assert hot.cluster == "dp" or not hot.used_ranks() <= {1, 3, 6}


def test_constraints_are_honoured() -> None:
    """Forced clusters (dp/rb/ub) are used, a forced layout is kept verbatim, every shard of a
    table with allowed ranks is on one of them, a forced precision is kept, and the plan still
    tiles every table within the memory cap."""
    planned = _constrained()
    plan = planned.plan
    assert plan["tiny1"].cluster == "rb"
    assert plan["huge"].cluster == "rb"
    assert plan["mid"].cluster == "ub"
    assert plan["wide"] == FORCED_LAYOUT
    assert plan["uni"].cluster == "rb"
    for name, allowed in (("hot", {1, 3, 6}), ("odd", {5}), ("uni", {0, 2, 4, 6})):
        assert {s.rank for s in plan[name].shards()} <= allowed, (name, plan[name])
    assert plan["odd"].precision == WirePrecision("bf16", "bf16")
    check_tiling(planned.spec, plan)
    assert memory_per_rank(planned.spec, plan).max() <= planned.topology.hbm_cap_bytes


def test_cluster_precision_config() -> None:
    """SearchConfig.precision sets the wire precision of each cluster's (unconstrained) tables."""
    fp16 = WirePrecision("fp16", "fp16")
    planned = plan_model(mixed_spec(), Topology(4, 2), config=SearchConfig(precision={"ub": fp16}))
    for name, cluster in planned.clusters.items():
        expected = fp16 if cluster == "ub" else WirePrecision()
        assert planned.plan[name].precision == expected, name
    assert "ub" in planned.clusters.values()


def test_constraints_for_unknown_tables_are_refused() -> None:
    """Constraints naming a table the model lacks are an error naming it."""
    with pytest.raises(ValueError, match="ghost"):
        plan_model(mixed_spec(), Topology(4, 2), {"ghost": TableConstraints(cluster="dp")})


# ---- failures ---------------------------------------------------------------------------------


def test_table_bigger_than_all_memory_raises() -> None:
    """A table larger than the memory of all ranks together is a PlanError saying the tables do not fit."""
    spec = ModelSpec("too-big", 1024, (TableSpec("small", 100, 16, 1.0), TableSpec("giant", 10_000_000, 16, 1.0)))
    topo = Topology(8, 4, with_memory(0.05))  # 8 x 50 MB < 680 MB
    with pytest.raises(PlanError, match="do not fit"):
        plan_model(spec, topo)


def test_forced_dp_table_over_the_cap_raises() -> None:
    """A table forced to DP that does not fit on one rank is refused, naming the rank over its cap."""
    spec = ModelSpec("dp-too-big", 1024, (TableSpec("a", 1_000_000, 64, 1.0),))
    with pytest.raises(PlanError, match="rank 0"):
        plan_model(spec, Topology(4, 2, with_memory(0.1)), {"a": TableConstraints(cluster="dp")})


# ---- cluster assignment -----------------------------------------------------------------------


def _cluster_spec(n_tiny: int = 4) -> ModelSpec:
    tiny = tuple(TableSpec(f"tiny{i}", 10 * (i + 1), 16, 4.0) for i in range(n_tiny))
    return ModelSpec("clusters", 16384, tiny + (TableSpec("big", 5_000_000, 128, 1.0),))


def test_tiny_tables_go_data_parallel_when_cheaper() -> None:
    """A tiny table whose DP cost (all-reduce + local lookups) is below its model-parallel share
    is assigned DP; a big table whose DP all-reduce is dear is not."""
    cost = CostModel(_cluster_spec(), Topology(8, 4))
    clusters = assign_clusters(cost, {})
    tiny, big = cost.table("tiny0"), cost.table("big")
    dp = mean_rank_ms(cost, "tiny0", TableLayout.data_parallel())
    mp = min(mean_rank_ms(cost, "tiny0", TableLayout.table_wise(tiny.rows, tiny.dim, 0, c)) for c in ("rb", "ub"))
    assert dp < mp  # the premise: DP is cheaper for the tiny table
    assert clusters["tiny0"] == "dp"
    assert mean_rank_ms(cost, "big", TableLayout.data_parallel()) > mean_rank_ms(
        cost, "big", TableLayout.table_wise(big.rows, big.dim, 0, "rb")
    )
    assert clusters["big"] in ("rb", "ub")


def test_dp_memory_fraction_is_respected() -> None:
    """DP candidates are accepted smallest first while their replicated memory fits in
    dp_memory_fraction of a rank's cap: fraction 0 gives none, a budget between the two and three
    smallest gives exactly the two smallest, and forced DP tables use up the budget first."""
    cost = CostModel(_cluster_spec(), Topology(8, 4))
    cap = cost.topology.hbm_cap_bytes
    mem = {f"tiny{i}": cost.table(f"tiny{i}").rows * cost.row_memory(f"tiny{i}", 16) for i in range(4)}
    assert all(assign_clusters(cost, {}, 1.0)[n] == "dp" for n in mem)  # all are DP candidates
    assert "dp" not in assign_clusters(cost, {}, 0.0).values()
    fraction = (mem["tiny0"] + mem["tiny1"] + mem["tiny2"] / 2) / cap
    clusters = assign_clusters(cost, {}, fraction)
    assert [n for n, c in clusters.items() if c == "dp"] == ["tiny0", "tiny1"]
    used = sum(mem[n] for n, c in clusters.items() if c == "dp")
    assert used <= fraction * cap
    # a forced DP table (tiny3, the biggest) takes its memory out of the same budget
    forced = assign_clusters(cost, {"tiny3": TableConstraints(cluster="dp")}, (mem["tiny3"] + mem["tiny0"] * 1.5) / cap)
    assert sorted(n for n, c in forced.items() if c == "dp") == ["tiny0", "tiny3"]


def test_allowed_ranks_exclude_dp() -> None:
    """A table limited to some ranks is never made DP (DP replicates it on every rank)."""
    cost = CostModel(_cluster_spec(), Topology(8, 4))
    clusters = assign_clusters(cost, {"tiny0": TableConstraints(ranks=(2, 3))}, 1.0)
    assert clusters["tiny0"] in ("rb", "ub")
    assert clusters["tiny1"] == "dp"


def test_ub_chosen_when_dedup_pays() -> None:
    """With a very low unique ratio (many repeated IDs) a big, high-pooling table goes UB; with
    unique ratio 1 it goes RB (partial sums are cheaper than sending every ID's vector)."""
    spec = ModelSpec(
        "ub",
        65536,
        (
            TableSpec("repeats", 5_000_000, 128, 100.0, unique_ratio=0.001),
            TableSpec("distinct", 5_000_000, 128, 100.0, unique_ratio=1.0),
        ),
    )
    free_collectives = PRESETS["dgx-h100"].with_overrides(collective_us=0.0)  # UB's group alone is not the question
    clusters = assign_clusters(CostModel(spec, Topology(16, 8, free_collectives)), {}, 0.0)
    assert clusters == {"repeats": "ub", "distinct": "rb"}
