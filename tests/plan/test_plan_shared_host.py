"""One host whose cores every rank shares (the cpu-gloo preset, a CPU calibration): the dense step and a collective's
cost are priced at the plan's world size, as measured at shared_host_ranks; elsewhere nothing changes. The plan
report says where its figures come from."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.model.hardware_file import hardware_fields, hardware_sources, hardware_to_dict, save_hardware
from embark_torchrec.plan.layout.tables import Plan, TableLayout
from embark_torchrec.plan.report import ScoredPlan, hardware_line, render
from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import PRESET_CHECKS, PRESETS, Topology

CPU = PRESETS["cpu-gloo"]


def _spec(world: int) -> ModelSpec:
    tables = [TableSpec(name=f"t{i}", rows=1000, dim=16, pooling=2.0, feature_names=(f"f{i}",)) for i in range(4)]
    return ModelSpec(name="m", tables=tuple(tables), batch_size=512 * world)


def _cost(world: int, hardware: object = CPU) -> CostModel:
    return CostModel(_spec(world), Topology(world, min(world, 2), hardware))  # type: ignore[arg-type]


def _table_wise(world: int) -> Plan:
    return Plan(world, min(world, 2), {f"t{i}": TableLayout.table_wise(1000, 16, i % world) for i in range(4)})


def test_figures_hold_at_the_ranks_they_were_measured_with() -> None:
    """At shared_host_ranks (2 for cpu-gloo, one rank per core) a collective costs collective_us and the dense step
    dense_ms_per_ksample per 1000 samples, as measured; a hardware file measured at 4 ranks prices 4 ranks as
    measured too."""
    assert Topology(2, 2, CPU).collective_us == CPU.collective_us
    assert _cost(2).dense_compute_ms == pytest.approx(0.512 * CPU.dense_ms_per_ksample)
    at_four = replace(CPU, shared_host_ranks=4, collective_us=7000.0, dense_ms_per_ksample=40.0)
    assert Topology(4, 2, at_four).collective_us == 7000.0
    assert _cost(4, at_four).dense_compute_ms == pytest.approx(0.512 * 40.0)


def test_ranks_beyond_the_cores_share_them_and_wait_for_each_other() -> None:
    """With more ranks than cores, each rank gets cores / ranks of a core (its dense step and its own part of a
    collective take ranks / cores as long) and each rank beyond the cores adds oversubscribed_collective_us to every
    collective; a file measured at 4 ranks gives back the 2-rank figures it implies."""
    cores = CPU.host_cores
    for world in (4, 8):
        share = world / cores
        assert Topology(world, 2, CPU).host_share == share
        expected = CPU.collective_us * share + CPU.oversubscribed_collective_us * (world - cores)
        assert Topology(world, 2, CPU).collective_us == pytest.approx(expected)
        assert _cost(world).dense_compute_ms == pytest.approx(0.512 * CPU.dense_ms_per_ksample * share)
    at_four = replace(CPU, shared_host_ranks=4, collective_us=Topology(4, 2, CPU).collective_us)
    assert Topology(2, 2, at_four).collective_us == pytest.approx(CPU.collective_us)
    estimate = {w: _cost(w).evaluate(_table_wise(w)) for w in (2, 4)}
    assert estimate[4].collective_ms > 2 * estimate[2].collective_ms  # each collective waits for descheduled ranks


def test_no_shared_host_no_change() -> None:
    """GPU presets (no shared host) and figures not marked with the ranks they were measured at price collectives and
    the dense step at their figures, whatever the world size."""
    for hardware in (PRESETS["dgx-h100"], replace(CPU, shared_host_ranks=0)):
        for world in (2, 4, 16):
            assert Topology(world, 2, hardware).host_share == 1.0
            assert Topology(world, 2, hardware).collective_us == hardware.collective_us


def test_report_says_where_the_figures_come_from() -> None:
    """A preset's report says every figure is the preset's and how far off the preset has been measured to be; a
    hardware file's sources name the measured figures and those left to the preset; an overridden preset says which
    were measured is not known."""
    cost = _cost(2)
    plan = _table_wise(2)
    text = render([ScoredPlan("embark", plan, cost.evaluate(plan), None)], cost.topology, "m")
    assert hardware_line(CPU) in text and PRESET_CHECKS["cpu-gloo"] in text
    assert "none measured on this machine" in hardware_line(PRESETS["dgx-h100"])
    line = hardware_line(
        CPU, {"name": "preset", "collective_us": "measured", "host_cores": "machine", "hbm_gb": "preset"}
    )
    assert "measured (calibrate, on this machine or model): collective_us, host_cores" in line
    assert line.endswith("from the base preset: hbm_gb")
    assert "is not known" in hardware_line(replace(CPU, collective_us=1.0))


def test_a_hardware_files_sources_reach_the_report(tmp_path: Path) -> None:
    """A hardware file's "sources" are read back for the report's hardware line (the example and EmbarkPlanner pass
    them to render); a preset has none."""
    document = {
        "format": "embark-hardware",
        "version": 1,
        "hardware": hardware_to_dict(CPU),
        "sources": {field: "measured" if field == "collective_us" else "preset" for field in hardware_fields()},
    }
    path = tmp_path / "hw.json"
    save_hardware(path, document)
    sources = hardware_sources(str(path))
    assert sources == document["sources"]
    assert "measured (calibrate, on this machine or model): collective_us;" in hardware_line(CPU, sources)
    assert hardware_sources("cpu-gloo") is None
