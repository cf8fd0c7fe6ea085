"""What a torchrun training script needs around the library: join the job (device, backend,
simulated nodes), average a value over ranks, keep step bookkeeping, and leave after a clean run.

The examples (examples/dlrm, examples/sequence) use it; so can a user's own script.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .nodes import simulate_nodes

__all__ = [
    "Progress",
    "World",
    "exit_after_clean_run",
    "init_distributed",
    "mean_over_ranks",
    "measured_window",
    "WARMUP_HELP",
]


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device


def init_distributed(local_world_size: int | None, timeout_s: float, script: str) -> World:
    """Join the job: CUDA + NCCL where there is a GPU, else CPU + gloo. `local_world_size` regroups the
    ranks into simulated nodes before TorchRec reads LOCAL_WORLD_SIZE for its intra/cross-node groups.
    Misuse (no torchrun, a bad local world size, too few GPUs) ends the script with one line naming it."""
    if "RANK" not in os.environ:
        raise SystemExit(f"start me with torchrun, e.g. torchrun --standalone --nproc_per_node 2 {script}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device_index = int(os.environ.get("LOCAL_RANK", "0"))  # the real one, before any regrouping
    if local_world_size is not None:
        try:
            simulate_nodes(local_world_size)
        except ValueError as e:
            raise SystemExit(f"--local-world-size: {e}") from None
    if torch.cuda.is_available():
        if device_index >= torch.cuda.device_count():
            raise SystemExit(
                f"local rank {device_index} needs cuda:{device_index}, this node has {torch.cuda.device_count()} GPUs"
            )
        device = torch.device("cuda", device_index)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
    else:  # under torchrun: a restarted group's keys apart from the attempt before (whose addresses are gone)
        store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = dist.PrefixStore(f"embark_attempt_{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    lws = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    return World(rank, world_size, lws, device)


def _all_reduced(value: float, device: torch.device, op: dist.ReduceOp.RedOpType) -> float:
    """`value` all-reduced over every rank (one all-reduce; for log and RESULT lines, not the hot path)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t)


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of `value` over every rank."""
    return _all_reduced(value, device, dist.ReduceOp.SUM) / dist.get_world_size()


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest `value` of any rank."""
    return _all_reduced(value, device, dist.ReduceOp.MAX)


WARMUP_HELP = "first steps left out of samples/s (pipelined, the last one too: it distributes no next batch)"


def measured_window(steps: int, warmup_steps: int, pipelined: bool) -> tuple[int, int]:
    """(after, through): throughput counts steps after + 1 .. through of a run of `steps` (counted from 1).

    The warm-up steps are left out, and so, under TrainPipelineSparseDist, is the last step: the pipeline distributes
    the next batch's IDs during each step, and the last has no next batch, so it is shorter than a steady step by an
    input dist. Counting it made a plan that sends many IDs look faster than it runs (by a fifth of its input dist
    at 15 steps with 10 warm-up). At least one step is always measured."""
    through = steps - 1 if pipelined and steps >= 3 else steps
    return min(warmup_steps, through - 1), through


@dataclass
class Progress:
    """Loss and throughput bookkeeping for log lines and a RESULT line."""

    first_loss: float | None = None
    last_loss: float | None = None
    measured_seconds: float = 0.0  # over the measured window (measured_window)
    measured_steps: int = 0
    data_seconds: float = 0.0  # making the batches (synthetic data, file reads), on this rank
    batches_made: int = 0
    window: tuple[int, int] = (0, 0)  # measured_window's (after, through), set by start
    clock: float = 0.0  # when the measured window began, moved on by pause

    def start(self, steps: int, warmup_steps: int, pipelined: bool) -> None:
        """Before the first of `steps` steps, every rank at once (after a barrier)."""
        self.window = measured_window(steps, warmup_steps, pipelined)
        self.clock = time.perf_counter()

    def step_done(self, done: int) -> None:
        """After the done-th step of the run (counted from 1): opens, counts and closes the measured window. Its end
        waits for every rank (a barrier), so that the window holds the slowest rank's steps."""
        after, through = self.window
        if done == after:
            self.clock = time.perf_counter()
        elif after < done <= through:
            self.measured_steps += 1
        if done == through:
            dist.barrier()
            self.measured_seconds = time.perf_counter() - self.clock

    def log_window(
        self, window_loss: torch.Tensor, window_steps: int, samples_per_step: int, since: float, device: torch.device
    ) -> tuple[float, float]:
        """A logging window's mean loss over ranks (window_loss: its steps' losses summed on this rank) and its
        samples/s since `since`; the run's first and last logged losses kept for the RESULT line. Every rank calls it
        (the mean is a collective)."""
        mean_loss = mean_over_ranks(float(window_loss) / window_steps, device)
        rate = window_steps * samples_per_step / (time.perf_counter() - since)
        if self.first_loss is None:
            self.first_loss = mean_loss
        self.last_loss = mean_loss
        return mean_loss, rate

    def pause(self, seconds: float) -> None:
        """Leave `seconds` spent inside the window on something else (a checkpoint save) out of it."""
        self.clock += seconds

    def timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, adding the time spent making each to data_seconds: the part of a step no plan changes."""
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.data_seconds += time.perf_counter() - start
            self.batches_made += 1
            yield batch


def exit_after_clean_run() -> None:
    """Flush and leave without interpreter teardown: after a clean run, torch 2.13's gloo threads
    sometimes abort it ("terminate called without an active exception", SIGABRT), failing the job
    after its last line; call it once the process group is destroyed and everything is saved."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
