"""Planning at scale: the search's work grows near-linearly with the tables and the ranks, counted (not
timed) on benchmarks/plan_time.py's synthetic models; the shortcuts that make it so price exactly
what the cost model does; and the progress line shows only where it should."""

from __future__ import annotations

import importlib.util
import io
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from embark_torchrec.plan.cost import load as load_module
from embark_torchrec.plan.cost import model as cost_module
from embark_torchrec.plan.search.clusters import assign_clusters
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.plan.plan_model import PlannedModel, plan_model
from embark_torchrec.plan.progress import ProgressLine, progress_line
from embark_torchrec.plan.search.config import SearchConfig, SearchStats
from embark_torchrec.plan.search.phases import SplitRounds
from embark_torchrec.plan.search.state import SearchState
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology
from tests.support.specs import HOT, HUGE, TINY, WIDE, with_memory

ROOT = Path(__file__).resolve().parents[2]
# (tables, ranks): 16x the tables at 16 ranks, 16x the ranks at 200 tables
SWEEPS = {"tables": ((100, 16), (1600, 16)), "ranks": ((200, 8), (200, 128))}
WORK_PER_TABLE_AND_PLACEMENT = 5.0
# work may grow at most this much faster than the tables or the ranks (a table cut into many cells probes more
# ranks per cell, ones it already holds: 1.7x from 8 to 128 ranks with dgx-h100's priced collectives; 16x if a
# placement scanned every rank)
NEAR_LINEAR = 2.0
IMPROVE_SLACK = 200  # candidates of the last table each climb of phase 3 looks at once its budget is spent


@lru_cache(maxsize=None)
def _plan_time() -> ModuleType:
    """benchmarks/plan_time.py as a module, for its synthetic models."""
    spec = importlib.util.spec_from_file_location("plan_time", ROOT / "benchmarks" / "plan_time.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_time"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=None)
def _planned(tables: int, ranks: int) -> PlannedModel:
    bench = _plan_time()
    return plan_model(bench.synthetic_spec(tables), bench.topology(ranks), progress=False)


def _work(tables: int, ranks: int) -> int:
    """Cells placed, ranks probed to place them, per-table loads summed into totals, tables scanned
    for the costliest ones, and per-table loads computed in full: each a bounded amount of work."""
    s = _planned(tables, ranks).stats
    return s.cells_placed + s.rank_probes + s.tables_summed + s.tables_scanned + s.loads_computed


def _per_table_and_placement(tables: int, ranks: int) -> float:
    return _work(tables, ranks) / (tables * _planned(tables, ranks).stats.placements)


@pytest.mark.parametrize("tables,ranks", [case for cases in SWEEPS.values() for case in cases])
def test_each_placement_does_bounded_work_per_table(tables: int, ranks: int) -> None:
    """A placement and its score touch each table a bounded number of times, however many tables and
    ranks there are: no scan of every rank per cell, no table-by-table pass inside a per-table loop, and
    no full recomputation of every table's load to score a plan (one-cell tables are renumbered)."""
    assert _per_table_and_placement(tables, ranks) <= WORK_PER_TABLE_AND_PLACEMENT
    assert _planned(tables, ranks).stats.loads_computed <= 0.5 * tables * _planned(tables, ranks).stats.placements


@pytest.mark.parametrize("sweep", SWEEPS)
def test_work_grows_near_linearly(sweep: str) -> None:
    """16x the tables (at 16 ranks) or the ranks (at 200 tables) costs at most NEAR_LINEAR x 16x the work: the
    work per table and placement does not grow, and neither do the rounds that need placements."""
    small, large = SWEEPS[sweep]
    growth = (large[0] * large[1]) / (small[0] * small[1])
    assert _work(*large) / _work(*small) <= NEAR_LINEAR * growth
    assert _per_table_and_placement(*large) <= NEAR_LINEAR * _per_table_and_placement(*small)


@pytest.mark.parametrize("tables,ranks", [SWEEPS["tables"][1], SWEEPS["ranks"][1]])
def test_improvement_work_is_its_budget(tables: int, ranks: int) -> None:
    """Phase 3 prices at most its budget of candidates (and what one table offers past it), each
    computing at most a few table loads in full (a re-split prices flat and hierarchical, a swap
    two tables), besides one load per table to start: fixed work, whatever the model."""
    s = _planned(tables, ranks).stats
    assert (
        s.improve_evaluations
        <= SearchConfig().improve_budget + (1 + len(SearchConfig().dp_batch_sizes)) * IMPROVE_SLACK
    )
    assert s.improve_loads_computed <= 4 * s.improve_evaluations + tables


def _mixed(world: int, local: int, hbm_gb: float) -> tuple[ModelSpec, Topology]:
    """Tables that go data-parallel, stay one cell, and (in little memory) must be cut, over several nodes."""
    tables = (
        HUGE,
        WIDE,
        TableSpec("ub", 50_000, 32, 10.0, unique_ratio=0.05),
        HOT,
        TINY,
        *(TableSpec(f"t{i}", 30_000 + 1000 * i, 36, 2.0 + i) for i in range(6)),
    )
    topology = Topology(world, local, with_memory(hbm_gb))
    return ModelSpec("mixed", 3 * 8192, tables, IdDistribution("zipf", 1.1)), topology


@pytest.mark.parametrize("world,local,hbm_gb", [(8, 4, 80.0), (8, 4, 0.1), (12, 3, 0.2), (4, 1, 80.0)])
def test_a_placements_score_is_the_cost_models_to_the_last_bit(world: int, local: int, hbm_gb: float) -> None:
    """The search adds one-cell tables into its totals by renumbering their rank-0 load
    (CostModel.add_in_order) and never builds their layouts; the total it scores equals
    CostModel.rank_load of the same layouts bit for bit, so the plans it picks are those a full
    evaluation of every candidate would pick."""
    spec, topology = _mixed(world, local, hbm_gb)
    cost = CostModel(spec, topology)
    state = SearchState(cost, assign_clusters(cost, {}), {}, SearchConfig())
    search = SplitRounds(SearchStats())
    search.prepare(state)
    _, placement = search.initial_placement()
    _, total = search.score(placement)
    layouts = {**state.fixed, **{n: search.placed_layout(placement, n) for n in state.movable}}
    expected = cost.rank_load(layouts)
    assert any(layouts[n].num_row_slices * layouts[n].num_col_slices == 1 for n in state.movable)
    assert np.array_equal(total.rows, expected.rows)
    assert (total.dp_intra, total.dp_inter, total.groups) == (expected.dp_intra, expected.dp_inter, expected.groups)


@pytest.mark.parametrize("cluster", ["rb", "ub"])
@pytest.mark.parametrize("world,local", [(24, 4), (4, 4)])
def test_loads_added_in_order_match_one_at_a_time(
    cluster: str, world: int, local: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CostModel.add_in_order adds what each table's full load on each rank adds, one table after
    another, to the last bit: one-cell tables renumbered from their load on rank 0, tables of several
    cells as given, over more tables than one stack holds (several nodes, and one)."""
    monkeypatch.setattr(cost_module, "_SUM_ELEMENTS", 512)
    spec, topology = _mixed(world, local, 80.0)
    cost = CostModel(spec, topology)
    rng = np.random.default_rng(0)
    tables = [spec.tables[i] for i in rng.integers(0, len(spec.tables), 600)]
    holders = rng.integers(0, world, len(tables))
    holders[rng.random(len(tables)) < 0.1] = -1  # these are cut in two row slices
    columns, full, expected = [], {}, rng.standard_normal((len(load_module._ROWS), world)) * 1e6
    start = expected.copy()
    for j, (t, k) in enumerate(zip(tables, holders.tolist())):
        base = cost.table_load(t.name, TableLayout.table_wise(t.rows, t.dim, 0, cluster))
        columns.append(cost.one_cell_columns(base))
        if k < 0:
            cut = TableLayout(cluster, (0, t.rows // 2, t.rows), (0, t.dim), ((j % world,), ((j + 1) % world,)))
            full[j] = cost.table_load(t.name, cut).rows
            expected += full[j]
        else:
            expected += cost.table_load(t.name, TableLayout.table_wise(t.rows, t.dim, k, cluster)).rows
    assert len(tables) * start.size > 10 * cost_module._SUM_ELEMENTS  # several stacks
    cost.add_in_order(start, np.stack(columns), holders, full)
    assert np.array_equal(start, expected)


def test_progress_line_waits_then_draws_one_line() -> None:
    """Nothing before the delay (quick plans print nothing); after it, one line redrawn in place with
    the stage and a bar when the total is known; close() ends it with the time taken."""
    out = io.StringIO()
    line = ProgressLine("planning m", out, delay_s=60.0)
    line("clusters", 1, 10)
    line.close()
    assert out.getvalue() == ""
    line = ProgressLine("planning m", out, delay_s=0.0, interval_s=0.0)
    line("clusters", 5, 10)
    line("split rounds", 3, None, "best 1.234 ms")
    line.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "clusters [##########..........] 5/10" in text and "split rounds 3, best 1.234 ms" in text
    assert "planning m: done in" in text
    out = io.StringIO()
    line = ProgressLine("planning m", out, delay_s=0.0, interval_s=60.0)
    line("improving", 1, 10)
    line("improving", 2, 10)  # within the interval: not drawn
    line("lower bound", 3, 10)  # a new stage: drawn at once
    text = out.getvalue()
    assert "1/10" in text and "2/10" not in text and "lower bound [" in text


def test_progress_only_where_asked() -> None:
    """progress_line draws on a terminal by default, never when told not to, always when asked; a
    Progress given to plan_model hears every stage, and plan_model(progress=False) prints nothing."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_line(None, stream=io.StringIO()) is None
    assert isinstance(progress_line(None, stream=Terminal()), ProgressLine)
    assert progress_line(False, stream=Terminal()) is None
    assert isinstance(progress_line(True, stream=io.StringIO()), ProgressLine)
    stages: list[str] = []
    spec, topology = _mixed(8, 4, 0.1)
    plan_model(spec, topology, progress=lambda stage, done, total, note: stages.append(stage))
    assert {"clusters", "placing", "split rounds", "polishing", "scoring"} <= set(stages)


def test_planner_shows_progress_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """EmbarkPlanner's default: rank 0 decides by its terminal, other ranks draw nothing; asked for
    (True) or not (False), every rank does as told."""
    from embark_torchrec.planner.planner import EmbarkPlanner

    for rank, expected in (("0", None), ("3", False)):
        monkeypatch.setenv("RANK", rank)
        assert EmbarkPlanner(world_size=8, local_world_size=4)._progress() is expected
        for asked in (True, False):
            assert EmbarkPlanner(world_size=8, local_world_size=4, progress=asked)._progress() is asked


def test_cli_progress_line_covers_every_stage(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """On a terminal, the CLI draws one progress line from the search to the report: the baselines'
    scoring and the plan's validation (10 s at 50,000 tables), the lower bound (20 s there) and the report
    are stages of it, and it ends once, before the report is printed."""
    from embark_torchrec.plan import cli

    stages: list[str] = []
    closed: list[int] = []

    class Recorder(ProgressLine):
        def __call__(self, stage: str, done: int, total: int | None = None, note: str = "") -> None:
            stages.append(stage)

        def close(self) -> None:
            closed.append(len(stages))

    monkeypatch.setattr(cli, "progress_line", lambda show, label: Recorder(label, io.StringIO()))
    assert cli.main(["dcnv2", "--world-size", "16", "--local-world-size", "8"]) == 0
    assert "lower bound" in capsys.readouterr().out
    kinds = list(dict.fromkeys(stages))
    for stage in ("clusters", "split rounds", "improving", "scoring", "scoring the baselines", "validating"):
        assert stage in kinds, stage
    for stage in ("lower bound", "report"):
        assert stage in kinds, stage
    assert kinds.index("improving") < kinds.index("validating") < kinds.index("lower bound") < kinds.index("report")
    assert closed == [len(stages)]
