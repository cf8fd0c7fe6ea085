"""The stage timer (--stage-times): our exchanges' waits count as the forward's or the backward's as they are, the
model's forward is timed, each step closes with its own stages, and on exit every method it replaced (TorchRec's
collectives' waits, its pipeline's stages) is the original again."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from embark_torchrec.sharding import collectives
from embark_torchrec.sharding.stage_times import STAGES, StageTimes, timing_stages
from embark_torchrec.sharding.torchrec_compat import collective_waits, pipeline_stages
from embark_torchrec.testing import fake_world


class _Exchanging(torch.nn.Module):
    """A model whose forward is one of our all-to-alls (as an output dist's)."""

    def __init__(self, group: object) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        segments = [[(6, 3)], [(6, 3)]]
        return collectives.all_to_all(x, segments, segments, self.group).wait()


def _replaced_methods() -> list[object]:
    return [owner.__dict__[method] for owner, method, _ in collective_waits() + pipeline_stages()]


def test_forward_and_backward_exchange_waits_and_steps_are_timed_and_methods_restored(tmp_path: Path) -> None:
    before = _replaced_methods()
    times = StageTimes()
    with fake_world(2) as group:
        model = _Exchanging(group)
        with timing_stages(times, model):
            assert _replaced_methods() != before  # TorchRec's waits and stages are being timed
            for _ in range(2):
                model(torch.randn(12, requires_grad=True)).sum().backward()
                times.step_done()
        model(torch.randn(12, requires_grad=True)).sum().backward()  # after it closed: nothing recorded
    assert _replaced_methods() == before
    assert not collectives._wait_observers
    assert len(times.steps) == 2
    for step in times.steps:
        assert set(step) == set(STAGES)
        assert step["forward"] >= step["forward_exchange_wait"] > 0.0
        assert step["backward_exchange_wait"] > 0.0
        assert step["step"] >= step["forward"] + step["backward_exchange_wait"]
        assert step["input_dist"] == step["batch"] == step["backward"] == 0.0  # no pipeline ran
    times.write(tmp_path / "rank1.json", 1)
    kept = json.loads((tmp_path / "rank1.json").read_text())
    assert kept == {"rank": 1, "stages": list(STAGES), "steps": times.steps}


def test_a_static_wait_method_stays_static_while_timed() -> None:
    """TorchRec calls its autograd functions' forward and backward on the class: a replaced one must stay static."""
    function, method, _ = collective_waits()[0]
    with fake_world(2) as group, timing_stages(StageTimes(), _Exchanging(group)):
        assert isinstance(function.__dict__[method], staticmethod)
