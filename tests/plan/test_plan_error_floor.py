"""benchmarks/plan_error_floor.py on a kept sweep made up here: where the steps ran as the cost model prices them
with one figure off (the dense step 4 times the file's), the predicted speedups miss the measured ones, and the
coordinate search finds figures at which every model's miss is gone: the floor it reports is what the figures can
reach, not a figure of the search."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from embark_torchrec.plan.model.hardware_file import load_hardware
from tests.support.benchmarks import load_benchmark, made_up_sweep
from tests.support.processes import ROOT

floor = load_benchmark("plan_error_floor")
fit = load_benchmark("fit_link_ratios")
sweeps = load_benchmark("sweep")
CALIBRATED = ROOT / "benchmarks" / "cluster_e2e_multihot_zipf_50mbit.hardware.json"


def test_the_search_reaches_the_figures_the_steps_ran_at(tmp_path: Path) -> None:
    calibrated = load_hardware(CALIBRATED)
    truth = calibrated.with_overrides(dense_ms_per_ksample=4 * calibrated.dense_ms_per_ksample)
    plans = fit.ran_plans(made_up_sweep(tmp_path, (3, 11), truth, CALIBRATED, torchrec_is_trw=True))
    links = {f: getattr(calibrated, f) for f in (*fit.FIELDS, "inter_node_phase_overlap")}
    before = floor.speedup_misses(plans, np.log([floor.estimated_ms(p, links, {}) / p.measured_ms for p in plans]))
    assert max(before) > 0.015
    factors, least = floor.least_worst_miss(plans, links)
    assert least == pytest.approx(0.0, abs=1e-3)
    assert factors != {f: 1.0 for f in floor.FIGURES}


def test_a_term_the_steps_pay_per_table_of_a_group_is_found_and_closes_the_misses(tmp_path: Path) -> None:
    """Steps that ran as priced plus 30 ms per table of one sharding group (table-row-wise, which only TorchRec's
    side of each model runs here): the misses that term makes are there as priced, the fit finds 30 ms on that group
    and none elsewhere, and each model's plans priced with the terms fitted on the others are their measured steps."""
    sweep = made_up_sweep(tmp_path, (3, 11, 5), load_hardware(CALIBRATED), CALIBRATED, torchrec_is_trw=True)
    trw_counts = floor.group_counts(fit.ran_plans(sweep)[-1])
    paid = max(trw_counts, key=trw_counts.get)
    for plan in fit.ran_plans(sweep):
        rounds_file = sweeps.model_folder(sweep, int(plan.model.split()[1])) / "rounds.json"
        rounds = json.loads(rounds_file.read_text())
        extra = 30.0 * floor.group_counts(plan).get(paid, 0)
        for r in rounds["runs"][plan.run]:
            r["step_ms"] += extra
            r["samples_per_s"] = 2048e3 / r["step_ms"]
        rounds_file.write_text(json.dumps(rounds))
    plans = fit.ran_plans(sweep)
    links = {f: getattr(load_hardware(CALIBRATED), f) for f in (*fit.FIELDS, "inter_node_phase_overlap")}
    priced = np.array([floor.estimated_ms(p, links, {}) for p in plans])
    measured = np.array([p.measured_ms for p in plans])
    assert max(floor.speedup_misses(plans, np.log(priced / measured))) > 0.01
    terms, ms, in_sample, out_of_sample = floor.missing_terms(plans, priced)
    assert dict(zip(terms, ms)) == pytest.approx({t: 30.0 if t == paid else 0.0 for t in terms}, abs=1e-6)
    assert in_sample == pytest.approx(measured, rel=1e-9) and out_of_sample == pytest.approx(measured, rel=1e-9)
    exact = floor.speedup_misses(plans, np.zeros(len(plans)))  # what the batch making alone leaves
    assert floor.speedup_misses(plans, np.log(out_of_sample / measured)) == pytest.approx(exact, abs=1e-9)
