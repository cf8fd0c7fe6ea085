"""Run a function on N ranks as threads of this process, on torch's multi-threaded ("threaded") process group.

Why: 4-16 ranks in well under a second, with no process start-up, for sharding types whose collectives the
threaded group implements (the project's notes record TW, RW, CW and DP as exact at 4, 8 and 16 ranks).

Limits:
  * TWRW (and anything else that uses TorchRec's intra/cross-node groups) fails, with a shape error in forward or a
    deadlock (seen both at 4 ranks x 2 per node): torchrec/distributed/comm.py caches those groups in module globals
    (``_INTRA_PG``/``_CROSS_PG``), which every thread shares. RW at the same size is exact; use run_ranks for TWRW.
  * Environment variables are process-wide: WORLD_SIZE and LOCAL_WORLD_SIZE are set for the duration of the call,
    RANK and LOCAL_RANK are removed (TorchRec then derives the local rank as rank % LOCAL_WORLD_SIZE). Inside ``fn``
    use ``dist.get_rank()``, not the environment, to learn the rank.
  * ``torch.set_num_threads`` is process-wide too, so it is left alone.
  * Threads cannot be killed. On a failure or timeout, ranks blocked in a collective are woken (they exit with
    SystemExit) and the rest are left as daemon threads; the call still returns promptly.
  * One call at a time per process (the threaded world is global state); calls are serialised by a lock.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

from embark_torchrec.testing._env import check_world, patched_environ
from embark_torchrec.testing.errors import RankError, RankFailure

__all__ = ["threaded_ranks"]

_STRAGGLER_GRACE_S = 2.0  # how long to wait for woken ranks to leave after a failure or timeout
_lock = threading.Lock()

_Outcome = tuple[int, bool, Any]  # (rank, ok, result or RankFailure)


def _set_thread_isolation(enabled: bool) -> None:
    """Per-thread functional-collective state, as torch's MultiThreadedTestCase sets around threaded tests."""
    torch._C._distributed_c10d._set_thread_isolation_mode(enabled)  # type: ignore[attr-defined]


def _rank_thread(
    rank: int,
    world_size: int,
    store: dist.Store,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    outcomes: queue.Queue[_Outcome],
) -> None:
    try:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        outcomes.put((rank, True, fn(*args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - SystemExit is how woken ranks leave; report it like the rest
        outcomes.put((rank, False, RankFailure.from_exception(rank, exc)))
        _wake_all()  # the ranks waiting for this one in a collective would otherwise wait forever
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wake_all() -> None:
    """Make every rank blocked in (or entering) a threaded collective leave it with SystemExit.

    Like ProcessLocalGroup.exception_handle, but it copies the open collectives under the group's lock, since other
    ranks may be opening or closing collectives at the same moment.
    """
    ProcessLocalGroup._terminate.set()
    with ProcessLocalGroup._coll_lock:
        collectives = list(ProcessLocalGroup._cur_coll_on_pgs.values())
    for collective in collectives:
        with collective._start_cond:
            collective._start_cond.notify_all()
        with collective._done_cond:
            collective._done_cond.notify_all()


def _woken(failure: RankFailure) -> bool:
    return failure.exc_type == "SystemExit"


def threaded_ranks(
    fn: Callable[..., Any],
    world_size: int,
    local_world_size: int | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` threads, each with its own "threaded" default process group.

    Returns the per-rank return values in rank order. Raises ``RankError`` (rank, exception, traceback) when a rank
    raises, ``TimeoutError`` naming the unfinished ranks after ``timeout_s``. The threaded world is uninstalled on
    return, so later calls (threaded or not) start clean.
    """
    lws = check_world(world_size, local_world_size)
    kwargs = dict(kwargs or {})
    env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(lws)}
    with _lock, patched_environ(env, remove=("RANK", "LOCAL_RANK", "GROUP_RANK")):
        if dist.is_initialized():
            raise RuntimeError("threaded_ranks needs no default process group in the calling thread")
        ProcessLocalGroup.reset()
        _set_thread_isolation(True)
        _install_threaded_pg()
        threads: list[threading.Thread] = []
        try:
            store = dist.HashStore()
            outcomes: queue.Queue[_Outcome] = queue.Queue()
            for rank in range(world_size):
                thread = threading.Thread(
                    target=_rank_thread,
                    args=(rank, world_size, store, fn, tuple(args), kwargs, outcomes),
                    name=f"rank{rank}",
                    daemon=True,
                )
                thread.start()
                threads.append(thread)
            return _collect(threads, outcomes, timeout_s)
        finally:
            _wake_all()  # no effect when every rank is done; wakes the stragglers of a failure or timeout
            grace_end = time.monotonic() + _STRAGGLER_GRACE_S
            for thread in threads:
                thread.join(max(0.0, grace_end - time.monotonic()))
            ProcessLocalGroup.reset()
            _uninstall_threaded_pg()
            _set_thread_isolation(False)


def _collect(threads: Sequence[threading.Thread], outcomes: queue.Queue[_Outcome], timeout_s: float) -> list[Any]:
    world_size = len(threads)
    deadline = time.monotonic() + timeout_s
    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    failures: list[RankFailure] = []
    while pending:
        try:
            rank, ok, value = outcomes.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(
                f"threaded_ranks timed out after {timeout_s:g} s; ranks still running: {sorted(pending)} "
                f"(of world size {world_size})"
            ) from None
        pending.discard(rank)
        if ok:
            results[rank] = value
        else:
            failures.append(value)
            break
    if failures:
        # Let the woken ranks report, then put the root cause (a real exception, not a wake-up exit) first.
        _wake_all()
        grace_end = time.monotonic() + _STRAGGLER_GRACE_S
        while pending and time.monotonic() < grace_end:
            try:
                rank, ok, value = outcomes.get(timeout=max(0.0, grace_end - time.monotonic()))
            except queue.Empty:
                break
            pending.discard(rank)
            if not ok:
                failures.append(value)
        failures.sort(key=_woken)
        raise RankError(world_size, failures)
    return results
