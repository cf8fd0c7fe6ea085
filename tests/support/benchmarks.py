"""The benchmark scripts (benchmarks/*.py are scripts, not a package) as modules, for the tests of their parts."""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from embark_torchrec.plan import CostModel, Hardware, Topology, plan_model, table_row_wise_plan
from tests.support.processes import ROOT

DATA_MS = 10.0  # a made-up sweep's batch making per step


@lru_cache(maxsize=None)
def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported once, with benchmarks/ on the path for the scripts it imports in turn."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if name in sys.modules:  # imported already by another script of benchmarks/
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def made_up_sweep(
    tmp_path: Path,
    seeds: tuple[int, ...],
    truth: Hardware,
    cluster_file: Path,
    torchrec_is_trw: bool = False,
    last_step_measured: bool = False,
) -> Path:
    """A kept sweep (benchmarks/sweep.py's folder, 2 nodes x 2 ranks) of generated models whose runs measured what
    the cost model prices with `truth` (plus batch making), each model's hardware file `cluster_file`: embark's run
    is the plan searched with `truth`, as is torchrec's (or, `torchrec_is_trw`, table-row-wise, as trw's always)."""
    sweep = load_benchmark("sweep")
    out = tmp_path / "sweep.md"
    topology = Topology(4, 2, truth)
    for seed in seeds:
        folder = sweep.model_folder(out, seed)
        folder.mkdir(parents=True)
        spec = sweep.generate_model(seed, sweep.RANGES)
        planned = spec.with_batch_size(4 * 512)
        ours, trw = plan_model(planned, topology).plan, table_row_wise_plan(planned, topology)
        plans = {"embark": ours, "torchrec": trw if torchrec_is_trw else ours, "torchrec-user": ours, "trw": trw}
        runs = {}
        for run, plan in plans.items():
            plan.save(folder / f"{run}.plan.json")
            step = CostModel(planned, topology).evaluate(plan).step_ms + DATA_MS
            runs[run] = [{"samples_per_s": 2048e3 / step, "step_ms": step, "data_ms_per_step": DATA_MS}]
        (folder / "spec.json").write_text(json.dumps(spec.to_dict()))
        (folder / "hardware.json").write_text(cluster_file.read_text())
        rounds = {"seed": seed, "world_size": 4, "local_world_size": 2, "batch_size": 512, "seconds": 1.0}
        (folder / "rounds.json").write_text(json.dumps(rounds | {"runs": runs}))
    settings = {"hardware": str(cluster_file)} | ({"last_step_measured": True} if last_step_measured else {})
    (out.with_suffix("") / "sweep.json").write_text(json.dumps(settings))
    return out
