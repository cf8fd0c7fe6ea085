"""Tests of embark_torchrec.testing itself: every later distributed test trusts these properties.

Spawns are batched: one 4-rank run serves the ordering/env/collective checks and warms the forkserver for the rest.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embark_torchrec.testing import RankError, fake_world, run_ranks, threaded_ranks

pytestmark = pytest.mark.torchrec_version

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


# ---------------------------------------------------------------- process identity, to prove ranks are gone


def _identity() -> tuple[int, str]:
    """(pid, start time): the start time tells our process apart from a later one that reuses the pid."""
    with open("/proc/self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return os.getpid(), fields[19]  # field 22 of proc(5), counted after the ")" that ends the command name


def _is_running(pid: int, start_time: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[19] == start_time and fields[0] != "Z"


def _record_identity(directory: str) -> None:
    """Write this rank's identity, then wait until every rank has, so none is killed before it could write."""
    pid, start_time = _identity()
    Path(directory, f"rank{dist.get_rank()}").write_text(f"{pid} {start_time}")
    dist.barrier()


def _assert_no_rank_left(directory: Path, world_size: int) -> None:
    for rank in range(world_size):
        pid_text, start_time = (directory / f"rank{rank}").read_text().split()
        assert not _is_running(int(pid_text), start_time), f"rank {rank} (pid {pid_text}) is still running"
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------- rank functions (module level: they must pickle)


def _report_rank() -> dict[str, Any]:
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "env": {key: os.environ[key] for key in ENV_KEYS},
        "all_reduce": total.item(),
        "num_threads": torch.get_num_threads(),
    }


def _raise_on_rank_one(directory: str) -> None:
    _record_identity(directory)
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    time.sleep(3600)  # rank 0 never finishes on its own: only the harness killing it ends the call early


def _die_on_rank_zero(directory: str) -> None:
    _record_identity(directory)
    if dist.get_rank() == 0:
        os._exit(3)  # no exception, no report: the harness must notice the death itself
    time.sleep(3600)


def _hang(directory: str) -> None:
    _record_identity(directory)
    if dist.get_rank() == 0:
        time.sleep(3600)
    else:
        dist.barrier()  # blocks in a collective, since rank 0 never joins


# ---------------------------------------------------------------- run_ranks


@pytest.fixture(scope="module")
def two_nodes_of_two() -> list[dict[str, Any]]:
    return run_ranks(_report_rank, world_size=4, local_world_size=2, timeout_s=120)


def test_results_come_back_in_rank_order_with_node_layout(two_nodes_of_two: list[dict[str, Any]]) -> None:
    """Property: result i is rank i's, and 4 ranks with local_world_size=2 see a 2 nodes x 2 ranks environment."""
    assert [r["rank"] for r in two_nodes_of_two] == [0, 1, 2, 3]
    assert [r["world_size"] for r in two_nodes_of_two] == [4, 4, 4, 4]
    expected_env = [
        {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"},
        {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"},
        {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"},
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"},
    ]
    assert [r["env"] for r in two_nodes_of_two] == expected_env
    assert [r["num_threads"] for r in two_nodes_of_two] == [1, 1, 1, 1]


def test_all_reduce_sums_over_all_ranks(two_nodes_of_two: list[dict[str, Any]]) -> None:
    """Property: the process group is real: all_reduce of (rank + 1) gives 1 + 2 + 3 + 4 on every rank."""
    assert [r["all_reduce"] for r in two_nodes_of_two] == [10.0] * 4


def test_rank_exception_fails_fast_with_its_traceback(tmp_path: Path, two_nodes_of_two: list[dict[str, Any]]) -> None:
    """Property: a raising rank fails the call at once (not at the timeout) with its rank, message and traceback,
    and the peer that would run forever is killed."""
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(_raise_on_rank_one, world_size=2, timeout_s=120, args=(str(tmp_path),))
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"took {elapsed:.1f} s: the harness waited instead of killing the other rank"
    error = caught.value
    assert error.rank == 1 and error.exc_type == "ValueError"
    text = str(error)
    assert text.startswith("rank 1 of 2 failed: ValueError: boom from rank 1")
    assert "Traceback (most recent call last)" in text and "in _raise_on_rank_one" in text
    _assert_no_rank_left(tmp_path, 2)


def test_rank_that_dies_without_exception_is_reported(tmp_path: Path, two_nodes_of_two: list[dict[str, Any]]) -> None:
    """Property: a rank that exits abruptly (no exception to send) still fails the call, naming rank and exit code."""
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(_die_on_rank_zero, world_size=2, timeout_s=120, args=(str(tmp_path),))
    assert time.monotonic() - start < 30
    assert caught.value.rank == 0
    assert "rank 0 exited with code 3" in str(caught.value)
    _assert_no_rank_left(tmp_path, 2)


def test_hanging_ranks_time_out_and_are_killed(tmp_path: Path, two_nodes_of_two: list[dict[str, Any]]) -> None:
    """Property: ranks that never finish (sleeping, or stuck in a collective) make the call raise TimeoutError
    soon after timeout_s, naming them, with no rank process left behind."""
    timeout_s = 6.0
    start = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        run_ranks(_hang, world_size=2, timeout_s=timeout_s, args=(str(tmp_path),))
    elapsed = time.monotonic() - start
    assert timeout_s <= elapsed < timeout_s + 10, f"elapsed {elapsed:.1f} s"
    assert "ranks still running: [0, 1]" in str(caught.value)
    _assert_no_rank_left(tmp_path, 2)


def test_unpicklable_fn_is_rejected_before_spawning() -> None:
    """Property: a lambda (which cannot reach a rank process) fails with a clear TypeError, not a hang."""
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(lambda: None, world_size=2)
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------- threaded_ranks


def _threaded_report() -> tuple[int, int, float, str, str]:
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return (
        dist.get_rank(),
        dist.get_world_size(),
        total.item(),
        os.environ["LOCAL_WORLD_SIZE"],
        threading.current_thread().name,
    )


def _threaded_raise_on_rank_three() -> None:
    if dist.get_rank() == 3:
        raise KeyError("thread boom")
    dist.all_reduce(torch.ones(1))  # the other ranks wait for rank 3 here and must be released


def _threaded_slow_rank_zero() -> None:
    if dist.get_rank() == 0:
        time.sleep(2.5)  # longer than the timeout; threads cannot be killed, so keep the overrun short
    dist.all_reduce(torch.ones(1))


def _assert_threaded_world_gone() -> None:
    assert not dist.is_initialized()
    assert type(dist.distributed_c10d._world).__name__ != "ThreadLocalWorld"


def test_threaded_ranks_eight_ranks_in_order_and_callable_twice() -> None:
    """Property: 8 threaded ranks all_reduce correctly and return in rank order; the world is cleaned up, so a
    second call (of another size) works too."""
    lws_before = os.environ.get("LOCAL_WORLD_SIZE")
    first = threaded_ranks(_threaded_report, world_size=8, local_world_size=4, timeout_s=60)
    assert first == [(r, 8, 36.0, "4", f"rank{r}") for r in range(8)]
    _assert_threaded_world_gone()
    second = threaded_ranks(_threaded_report, world_size=4, timeout_s=60)
    assert second == [(r, 4, 10.0, "4", f"rank{r}") for r in range(4)]
    _assert_threaded_world_gone()
    assert os.environ.get("LOCAL_WORLD_SIZE") == lws_before


def test_threaded_rank_exception_is_reraised_with_traceback() -> None:
    """Property: a raising thread fails the call promptly with its rank and traceback, releasing the ranks that
    wait for it in a collective; a later call still works."""
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        threaded_ranks(_threaded_raise_on_rank_three, world_size=4, timeout_s=60)
    assert time.monotonic() - start < 10
    assert caught.value.rank == 3 and caught.value.exc_type == "KeyError"
    assert "thread boom" in str(caught.value) and "in _threaded_raise_on_rank_three" in str(caught.value)
    _assert_threaded_world_gone()
    assert threaded_ranks(_threaded_report, world_size=2) == [(0, 2, 3.0, "2", "rank0"), (1, 2, 3.0, "2", "rank1")]


def test_threaded_ranks_time_out() -> None:
    """Property: threads that do not finish within timeout_s raise TimeoutError naming them, promptly."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks still running: \[0, 1, 2, 3\]"):
        threaded_ranks(_threaded_slow_rank_zero, world_size=4, timeout_s=1.0)
    assert time.monotonic() - start < 8
    _assert_threaded_world_gone()
    assert threaded_ranks(_threaded_report, world_size=2) == [(0, 2, 3.0, "2", "rank0"), (1, 2, 3.0, "2", "rank1")]


# ---------------------------------------------------------------- fake_world

PLAN_TABLES = [
    EmbeddingBagConfig(
        name=f"t{i}",
        embedding_dim=(16, 64, 128)[i % 3],
        num_embeddings=(1_000, 100_000, 5_000_000)[i % 3],
        feature_names=[f"f{i}"],
    )
    for i in range(6)
]


def test_fake_world_builds_a_128_rank_plan() -> None:
    """Property: with a 128-rank fake group the stock planner's collective_plan places every table on ranks < 128
    (and beyond the first node, which a smaller world could not), and the group is gone afterwards."""
    ebc = EmbeddingBagCollection(tables=PLAN_TABLES, device=torch.device("meta"))
    with fake_world(128) as pg:
        assert dist.get_world_size() == 128 and pg.size() == 128
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=128, compute_device="cuda", local_world_size=8))
        plan = planner.collective_plan(ebc, [EmbeddingBagCollectionSharder()], pg)
    assert not dist.is_initialized()
    module_plan = plan.plan[""]
    assert sorted(module_plan) == sorted(t.name for t in PLAN_TABLES)
    used: set[int] = set()
    for name, sharding in module_plan.items():
        assert sharding.ranks, f"{name} has no ranks"
        assert all(0 <= r < 128 for r in sharding.ranks), (name, sharding.ranks)
        used.update(sharding.ranks)
    assert max(used) >= 8
