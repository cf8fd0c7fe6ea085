"""Run a function on N real ranks (one process each, gloo on localhost) and get the per-rank results back.

Why processes: this is the only harness where every TorchRec code path (TWRW's intra/cross-node groups, DDP, the
fused kernels) behaves as in production. Why a forkserver with preloaded modules: importing torchrec costs several
seconds per process; the forkserver imports it once and forks every rank from that warm image.

Limits:
  * ``fn``, ``args``, ``kwargs`` and the return values must pickle (``fn`` a module-level function).
  * Rank processes are daemonic, so ``fn`` cannot start child processes of its own (e.g. DataLoader workers).
  * The forkserver inherits the stdout/stderr in force when it starts (under pytest: the first test's capture), so
    prints from ranks may not show; failures come back through the result pipe instead, with their tracebacks.
  * ``set_forkserver_preload`` is process-global: it also applies to other users of the "forkserver" start method,
    and it has no effect if the forkserver was already started before the first ``run_ranks`` call.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.forkserver as mp_forkserver
import multiprocessing.resource_tracker as mp_resource_tracker
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from embark_torchrec.testing._env import check_world, rank_env
from embark_torchrec.testing.errors import RankError, RankFailure

__all__ = ["PRELOAD_MODULES", "RankError", "run_ranks"]

#: Imported once in the forkserver, so every rank starts with them loaded. Missing ones are skipped silently.
PRELOAD_MODULES: list[str] = [
    "torch",
    "torch.distributed",
    "fbgemm_gpu",
    "torchrec",
    "torchrec.distributed",
    "torchrec.distributed.model_parallel",
    "torchrec.distributed.planner",
    "embark_torchrec.testing",
]

_HOST = "127.0.0.1"
_KILL_GRACE_S = 3.0  # between SIGTERM and SIGKILL
_EXIT_GRACE_S = 10.0  # for ranks that reported success to tear down their process group and exit

_context: ForkServerContext | None = None
_context_lock = threading.Lock()


def _mp_context() -> ForkServerContext:
    """The forkserver context, with PRELOAD_MODULES registered before the server first starts."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = mp.get_context("forkserver")
            assert isinstance(ctx, ForkServerContext)
            ctx.set_forkserver_preload(PRELOAD_MODULES)
            atexit.register(_stop_helper_processes)
            _context = ctx
        return _context


def _stop_helper_processes() -> None:
    """At exit, end and reap the forkserver and the resource tracker instead of leaving them to exit after us.

    Left alone, the forkserver lingers ~2 s in interpreter shutdown (torch is loaded), and both become orphans that
    a container's init may never reap (they show up as zombies). Every rank has been reaped by the time this runs.
    """
    server = getattr(mp_forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is not None and pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)  # it holds nothing to flush
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        server._forkserver_pid = None
    tracker = getattr(mp_resource_tracker, "_resource_tracker", None)
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if tracker is not None and fd is not None and pid is not None:
        os.close(fd)  # EOF asks it to clean up and exit; it may still be held by live processes we did not start
        tracker._fd = tracker._pid = None
        deadline = time.monotonic() + 5.0
        try:
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.02)
        except ChildProcessError:
            pass


def _exit_when_parent_dies() -> None:
    """Ranks are children of the forkserver, not of the caller: end them if the caller is killed outright."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(70)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _rank_main(
    rank: int,
    world_size: int,
    local_world_size: int,
    backend: str,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    conn: mp_connection.Connection,
) -> None:
    """Entry point of one rank: join the group, run fn, report before tearing down so peers can be stopped at once."""
    _exit_when_parent_dies()
    os.environ.update(rank_env(rank, world_size, local_world_size))
    os.environ.update({"MASTER_ADDR": _HOST, "MASTER_PORT": str(port)})
    torch.set_num_threads(1)  # N ranks share a few cores; intra-op threads would only oversubscribe them
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(*args, **kwargs)
        payload = pickle.dumps(("ok", result))  # plain pickle: copies tensor data instead of sharing it via fds
    except BaseException as exc:  # noqa: BLE001 - every failure, SystemExit included, must reach the parent
        payload = pickle.dumps(("err", RankFailure.from_exception(rank, exc)))
    try:
        conn.send_bytes(payload)
        conn.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _died_without_report(rank: int, proc: BaseProcess) -> RankFailure:
    proc.join(_KILL_GRACE_S)
    code = proc.exitcode
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return RankFailure(rank, "RankDied", f"rank {rank} {how} without reporting a result", f"(no traceback: {how})\n")


def _read_outcome(rank: int, proc: BaseProcess, conn: mp_connection.Connection) -> tuple[bool, Any]:
    """(True, value) for a result, (False, RankFailure) for a failure, read from the rank's pipe."""
    try:
        status, value = pickle.loads(conn.recv_bytes())
    except EOFError:
        return False, _died_without_report(rank, proc)
    except Exception as exc:  # noqa: BLE001 - e.g. the result's class does not import in the caller
        return False, RankFailure.from_exception(rank, exc)
    return status == "ok", value


def _stop(procs: Sequence[BaseProcess]) -> None:
    """Terminate, then kill, then reap every rank still alive; never returns with one running."""
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _collect(
    procs: Sequence[BaseProcess], conns: Sequence[mp_connection.Connection], timeout_s: float, deadline: float
) -> list[Any]:
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    rank_of = {id(conn): rank for rank, conn in enumerate(conns)}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"run_ranks timed out after {timeout_s:g} s; ranks still running: {sorted(pending)} "
                f"(of world size {world_size}); all rank processes were killed"
            )
        # A pipe becomes readable on a result and on EOF (the rank died), so the pipes alone are enough to wait on.
        ready = mp_connection.wait([conns[r] for r in sorted(pending)], timeout=remaining)
        failures: list[RankFailure] = []
        for conn in ready:
            rank = rank_of[id(conn)]
            ok, value = _read_outcome(rank, procs[rank], conns[rank])
            pending.discard(rank)
            if ok:
                results[rank] = value
            else:
                failures.append(value)
        if failures:
            # Take whatever other failures are already in (often consequences), then let the caller kill the rest.
            for conn in mp_connection.wait([conns[r] for r in sorted(pending)], timeout=0):
                rank = rank_of[id(conn)]
                ok, value = _read_outcome(rank, procs[rank], conns[rank])
                if not ok:
                    failures.append(value)
            raise RankError(world_size, failures)
    return results


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    local_world_size: int | None = None,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` processes with the default process group initialised.

    Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT, so e.g.
    ``world_size=4, local_world_size=2`` looks like 2 nodes x 2 ranks to TorchRec. Returns the per-rank return values
    in rank order. Raises ``RankError`` (rank number, exception and traceback text) as soon as one rank fails, after
    killing the others; raises ``TimeoutError`` naming the unfinished ranks after ``timeout_s`` (start-up included).
    No rank process outlives the call.
    """
    lws = check_world(world_size, local_world_size)
    kwargs = dict(kwargs or {})
    try:
        pickle.dumps((fn, tuple(args), kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_ranks needs a picklable fn/args/kwargs (fn must be a module-level function): {exc}"
        ) from exc
    ctx = _mp_context()
    deadline = time.monotonic() + timeout_s
    # The caller hosts the rendezvous store on a port the OS picks, so concurrent runs can never collide on a port.
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    procs: list[BaseProcess] = []
    conns: list[mp_connection.Connection] = []
    finished = False
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            conns.append(reader)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, world_size, lws, backend, store.port, timeout_s, fn, tuple(args), kwargs, writer),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            writer.close()  # keep only the rank's copy, so its death shows up as EOF here
        results = _collect(procs, conns, timeout_s, deadline)
        finished = True
        return results
    finally:
        if finished:
            exit_deadline = time.monotonic() + _EXIT_GRACE_S
            for started in procs:
                started.join(max(0.0, exit_deadline - time.monotonic()))
        _stop(procs)
        for conn in conns:
            conn.close()
        del store
