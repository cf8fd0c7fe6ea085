"""benchmarks/step_stages.py on sweep 8's kept model 2101431386 (its spec, hardware file and plans) with stage files
made up here: a rank's stages are medians over the steps after the warm-up and then over rounds, each plan's priced
phases are the cost model's own (CostModel.phase_network_ms, the paired premium), and a round without stage files is
an error naming its folder (the runs need the emulated cluster: `make test` starts none)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from embark_torchrec.plan import Plan
from tests.support.benchmarks import load_benchmark
from tests.support.processes import ROOT

stages = load_benchmark("step_stages")
SEED = 2101431386
SOURCE = ROOT / "benchmarks" / "sweep8" / f"seed{SEED}"
WARMUP = 2


def _stage_file(folder: Path, run: str, round_index: int, rank: int, forward: list[float]) -> None:
    """A rank's steps: every stage 1 ms but the forward, which takes `forward` step by step."""
    steps = [dict.fromkeys(stages.STAGES, 1.0) | {"forward": ms} for ms in forward]
    out = stages.stage_folder(folder, run, round_index) / f"rank{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rank": rank, "stages": list(stages.STAGES), "steps": steps}))


def _kept_model(tmp_path: Path) -> Path:
    folder = tmp_path / "step_stages" / f"seed{SEED}"
    folder.mkdir(parents=True)
    for name in ("spec.json", "hardware.json", "embark.plan.json", "torchrec.plan.json"):
        shutil.copyfile(SOURCE / name, folder / name)
    runs = {run: [{"step_ms": ms + 10.0, "data_ms_per_step": 10.0} for ms in steps]
            for run, steps in (("embark", [380.0, 370.0]), ("torchrec", [640.0, 650.0]))}  # fmt: skip
    rounds = {"seed": SEED, "sweep": "benchmarks/sweep8.md", "world_size": 4, "local_world_size": 2,
              "batch_size": 2048, "warmup_steps": WARMUP, "seconds": 60.0, "runs": runs}  # fmt: skip
    (folder / "rounds.json").write_text(json.dumps(rounds))
    for run in stages.PLANS:
        for rank in range(4):
            # warm-up steps far off; the rounds' medians 10 + rank and 30 + rank: their median 20 + rank
            _stage_file(folder, run, 0, rank, [900.0, 800.0, 10 + rank, 9 + rank, 11 + rank])
            _stage_file(folder, run, 1, rank, [900.0, 800.0, 30 + rank, 31 + rank, 29 + rank])
    return folder


def test_stages_are_medians_after_the_warm_up_then_over_rounds_beside_the_model_s_phases(tmp_path: Path) -> None:
    folder = _kept_model(tmp_path)
    rounds, plans = stages.model_stages(folder)
    assert [p.run for p in plans] == ["embark", "torchrec"]
    for p in plans:
        assert sorted(p.stages) == [0, 1, 2, 3]
        for rank, measured in p.stages.items():
            assert measured["forward"] == 20 + rank
            assert all(measured[s] == 1.0 for s in stages.STAGES if s != "forward")
        cost = stages.kept_cost(folder, stages.kept_spec(folder), rounds)
        plan = Plan.load(folder / f"{p.run}.plan.json")
        rows = cost.rank_load(plan).rows
        for name, priced in zip(("ids", "forward", "gradients"), cost.phase_network_ms(rows)):
            np.testing.assert_array_equal(p.phases[name], priced)
        assert p.priced_ms == cost.evaluate(plan).step_ms
    assert plans[0].measured_ms == 375.0 and plans[1].measured_ms == 645.0  # the rounds' steps less the batch making
    assert (plans[0].phases["paired_premium"] > 0).all()  # embark's plan holds hierarchical tables
    page = stages.markdown([(rounds, plans)], "note")
    assert f"## Seed {SEED} (benchmarks/sweep8.md)" in page
    ids, forward, grads = plans[0].phases["ids"], plans[0].phases["forward"], plans[0].phases["gradients"]
    assert f"| 2 | 1 | 1 | 1 | 22 | 1 | 1 | 1 | {plans[0].phases['lookup'][2]:,.0f} | {ids[2]:,.0f} | " in page
    assert f"{forward[2]:,.0f} | {grads[2]:,.0f} |" in page


def test_a_round_without_stage_files_is_an_error_naming_its_folder(tmp_path: Path) -> None:
    folder = _kept_model(tmp_path)
    shutil.rmtree(stages.stage_folder(folder, "torchrec", 1))
    with pytest.raises(FileNotFoundError, match="torchrec/round2"):
        stages.model_stages(folder)
