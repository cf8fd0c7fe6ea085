"""Our all-to-all carries profiler labels in TorchRec's style, so that a trace of a step reads like one of TorchRec's
(its comm_ops label "## all2all_pooled ##", "## All2All_Pooled_fwd ##", ...): the call, the forward exchange's start,
its wait, and the gradients' exchange in the backward."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from embark_torchrec.sharding import collectives
from embark_torchrec.testing import fake_world


def test_all_to_all_forward_wait_and_backward_are_labelled() -> None:
    with fake_world(2) as group:
        x = torch.randn(12, requires_grad=True)
        segments = [[(6, 3)], [(6, 3)]]  # 6 elements of 3-wide rows to each of the 2 members
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = collectives.all_to_all(x, segments, segments, group).wait()
            out.sum().backward()
    names = [event.name for event in prof.events()]
    for label in (
        collectives.ALL_TO_ALL_LABEL,
        collectives.FORWARD_LABEL,
        collectives.WAIT_LABEL,
        collectives.BACKWARD_LABEL,
    ):
        assert label in names, (label, sorted(set(n for n in names if "##" in n)))
    assert names.count(collectives.WAIT_LABEL) == 2  # the forward's result and, in the backward, the gradients'
