"""Where a training step's time goes on one rank: its stages, and how long the embedding exchanges kept it waiting.

Per step, in ms: the whole step; making the next batch (`batch`); the input dists' starts and waits (`input_dist`,
TorchRec's pipeline only: with it, the IDs' all-to-all of the next batch runs during this step's backward); the
model's forward (`forward`, which waits for its IDs' exchange) and the part of it spent waiting for the output dists'
exchanges (`forward_exchange_wait`: ours and TorchRec's); the backward (`backward`) and its waits for the gradients'
exchanges (`backward_exchange_wait`). The example's --stage-times writes them per rank; benchmarks/step_stages.py sets
them beside the cost model's phases of the same plan.
"""

from __future__ import annotations

import functools
import json
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import torch

from .collectives import observing_waits
from .torchrec_compat import collective_waits, pipeline_stages

STAGES = ("step", "batch", "input_dist", "forward", "forward_exchange_wait", "backward", "backward_exchange_wait")


class StageTimes:
    """One rank's stage times, step by step, in ms (STAGES)."""

    def __init__(self) -> None:
        self.steps: List[Dict[str, float]] = []
        self._current: Dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self._step_start = time.perf_counter()

    def add(self, stage: str, seconds: float) -> None:
        self._current[stage] += seconds * 1e3

    def step_done(self) -> None:
        """Closes the step begun at the previous call (or at construction)."""
        now = time.perf_counter()
        self._current["step"] = (now - self._step_start) * 1e3
        self.steps.append(self._current)
        self._current, self._step_start = dict.fromkeys(STAGES, 0.0), now

    def write(self, path: Path, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": rank, "stages": list(STAGES), "steps": self.steps}))


def _timed(function: Callable[..., Any], on_done: Callable[[float], None]) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            on_done(time.perf_counter() - start)

    return timed


@contextmanager
def _replaced(owner: type, name: str, on_done: Callable[[float], None]) -> Iterator[None]:
    """owner.name timed while open (a static method stays one), put back on exit."""
    original = owner.__dict__[name]
    if isinstance(original, staticmethod):
        setattr(owner, name, staticmethod(_timed(original.__func__, on_done)))
    else:
        setattr(owner, name, _timed(original, on_done))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def timing_stages(times: StageTimes, model: torch.nn.Module) -> Iterator[StageTimes]:
    """While open, `model`'s forward, TorchRec's pipeline stages and every embedding exchange's wait (ours and
    TorchRec's) add to `times`; the caller closes each step (StageTimes.step_done) and times a plain loop's backward
    itself. For a diagnostic run only: it replaces methods of TorchRec's classes process-wide until it closes."""

    def wait(backward: bool, seconds: float) -> None:
        times.add("backward_exchange_wait" if backward else "forward_exchange_wait", seconds)

    forward_start: List[float] = []
    with ExitStack() as stack:
        stack.enter_context(observing_waits(wait))
        for function, method, backward in collective_waits():
            stack.enter_context(_replaced(function, method, functools.partial(wait, backward)))
        for owner, method, stage in pipeline_stages():
            stack.enter_context(_replaced(owner, method, functools.partial(times.add, stage)))
        pre = model.register_forward_pre_hook(lambda *_: forward_start.append(time.perf_counter()))
        post = model.register_forward_hook(lambda *_: times.add("forward", time.perf_counter() - forward_start.pop()))
        stack.callback(pre.remove)
        stack.callback(post.remove)
        yield times
