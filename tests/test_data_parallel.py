"""DDP's all-reduce precision reaches DMP as a plan says: sharding.data_parallel.data_parallel_wrapper (the bytes
it sends are checked against the kernel's link counters in tests/test_cluster.py)."""

from __future__ import annotations

import pytest
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

from embark_torchrec.plan.layout import Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.sharding.data_parallel import data_parallel_wrapper


def test_wrapper_takes_the_plans_precision_and_refuses_what_ddp_cannot_run() -> None:
    """A plan's data-parallel tables travel in DDP's buckets with the dense part: one precision, named otherwise."""
    same = Plan(2, 2, {"t": TableLayout.data_parallel(WirePrecision("fp32", "fp16"))}, {}, "fp16")
    assert isinstance(data_parallel_wrapper(same), DefaultDataParallelWrapper)
    other = Plan(2, 2, {"t": TableLayout.data_parallel(WirePrecision("fp32", "bf16"))}, {}, "fp16")
    with pytest.raises(PlanError, match="table 't'.*bf16.*fp16"):
        data_parallel_wrapper(other)
    with pytest.raises(ValueError, match="fp8"):
        data_parallel_wrapper("fp8")
