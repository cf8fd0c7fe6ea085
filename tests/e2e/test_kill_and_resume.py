"""Kill and resume: a run whose rank is SIGKILLed and resumed from its last checkpoint ends where an
uninterrupted run ends; a run that loses a node continues on fewer ranks, and grows back.

The DLRM example runs under torchrun on 2 CPU ranks: (A) N steps straight; (B) the same, saving every K steps, with
rank 1 killed by SIGKILL after step 2K+1 has been logged (torchrun must then stop the job, no hang); (C) B resumed
with --resume. Before C, B's directory gets what resume must fall back from: a newest step N of another
model (it verifies; DCP cannot load it), steps 2K+2 and 2K+1 with a manifest nested too deep to parse and one with a
5,000-digit number, and step 2K left as a re-save that stopped between its two renames (its only verified copy is
step_<2K>.replaced). C must name each of them, resume at step 2K from the .replaced copy, log the same losses as A
for every step after it, and end with the same weights and optimizer state as A, bit for bit (both final checkpoints,
read back with torch.distributed.checkpoint's single-process reader; C's final save replaces the foreign step N).

Under `torchrun --max-restarts 3` with --resume, the same kill needs no second command: torchrun restarts both
workers, which resume from step 2K and end as A does (weights, optimizer state and AUC). A lost node (2 simulated
nodes x 2 ranks, node 1's ranks killed) is continued by a relaunch at 1 node x 2 ranks from the newest verified step
with a new plan, and a relaunch at 2 x 2 grows it back.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from embark_torchrec.checkpoint import (
    MANIFEST_NAME,
    checkpoint_path,
    release_checkpoint_directory,
    save_checkpoint,
    verify_checkpoint,
)
from tests.support.checkpoints import HOSTILE_MANIFESTS, leave_rename_window
from tests.support.processes import ROOT, checkout_env

TRAIN = ROOT / "examples" / "dlrm" / "train.py"
STEPS, EVERY = 12, 4
KILL_AFTER = 2 * EVERY + 1  # killed after this step is logged: the last checkpoint is at 2K


def _command(*extra: str, nproc: int = 2, torchrun: tuple[str, ...] = ()) -> list[str]:
    """The example under torchrun (`torchrun`: its own flags) on `nproc` ranks, STEPS steps unless `extra` says."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *torchrun,
        str(TRAIN), "--steps", str(STEPS), "--log-every", "1", "--seed", "3", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return checkout_env(OMP_NUM_THREADS="1")


def _losses(out: str) -> dict[int, str]:
    """Logged mean loss per step ("step 9: loss 0.6931, ..."), as printed."""
    found = {}
    for line in out.splitlines():
        if line.startswith("step ") and ": loss " in line:
            head, rest = line.split(": loss ", 1)
            found[int(head.split()[1])] = rest.split(",")[0]
    return found


def _result(out: str) -> dict[str, Any]:
    """The example's RESULT line (printed once, by rank 0, when it finishes)."""
    (line,) = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _worker_of_rank(torchrun_pid: int, rank: int) -> int:
    for pid in _children(torchrun_pid):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} under torchrun pid {torchrun_pid}")


def _start_and_kill(cmd: list[str], ranks: tuple[int, ...], after: int) -> tuple[subprocess.Popen[str], list[str]]:
    """Starts `cmd` (torchrun) and SIGKILLs the workers of `ranks` once step `after` is logged; the process, still
    running, and the lines it printed so far (stdout and stderr together)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {after}: loss"):
            for rank in ranks:
                os.kill(_worker_of_rank(proc.pid, rank), signal.SIGKILL)
            return proc, seen
    proc.wait(timeout=60)
    raise AssertionError(f"step {after} was never logged:\n" + "".join(seen)[-3000:])


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Run A: STEPS steps without interruption, its final checkpoint in the returned directory; its output."""
    directory = tmp_path_factory.mktemp("straight") / "a"
    proc = subprocess.run(
        _command("--checkpoint-dir", str(directory)), capture_output=True, text=True, env=_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, directory


def _assert_same_state(a: Path, b: Path, tmp: Path) -> None:
    """The final checkpoints in directories a and b hold the same tensors, bit for bit (model and optimizers)."""
    want, got = _final_state(a, tmp), _final_state(b, tmp)
    assert sorted(want) == sorted(got) and any("embedding_bags" in k for k in want), sorted(want)[:10]
    for key in want:
        assert torch.equal(want[key], got[key]), key


def _final_state(directory: Path, tmp: Path) -> dict[str, torch.Tensor]:
    flat = tmp / f"{directory.name}.pt"
    dcp_to_torch_save(directory / f"step_{STEPS:08d}", flat)
    state = torch.load(flat, weights_only=False)
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, torch.Tensor):
            out[prefix] = value

    walk("", state)
    return out


def _plant_what_resume_must_skip(directory: Path) -> list[str]:
    """Newer steps that verify but are another model's, or whose manifest is hostile, and the last good step left in
    the rename window; returns the starts of the lines resume must print about them."""
    save_checkpoint(directory, {"other_model": torch.zeros(3)}, STEPS)
    release_checkpoint_directory(directory)  # this process saved into it: give it back for run C
    hostile = {2 * EVERY + 2: "deeply_nested_json", 2 * EVERY + 1: "5000_digit_step"}
    for step, name in hostile.items():
        shutil.copytree(checkpoint_path(directory, 2 * EVERY), checkpoint_path(directory, step))
        HOSTILE_MANIFESTS[name][0](checkpoint_path(directory, step))
    replaced = leave_rename_window(directory, 2 * EVERY)
    reasons = {f"step_{STEPS:08d}": "DCP could not load", f"step_{2 * EVERY:08d}.partial": "unfinished save"}
    for step in hostile:
        reasons[f"step_{step:08d}"] = f"manifest {checkpoint_path(directory, step) / MANIFEST_NAME} is unreadable"
    lines = [f"skipped checkpoint {directory / name}: {reason}" for name, reason in reasons.items()]
    return [*lines, f"resumed from {replaced} at step {2 * EVERY}"]


def test_killed_and_resumed_run_ends_like_an_uninterrupted_one(tmp_path: Path, straight: tuple[str, Path]) -> None:
    """Same losses after the checkpoint, same final weights and optimizer state, and no hang when a rank dies; resume
    names each newer step it cannot use and loads the only verified copy of the last good one."""
    killed, seen = _start_and_kill(
        _command("--checkpoint-dir", str(tmp_path / "b"), "--save-every", str(EVERY)), ranks=(1,), after=KILL_AFTER
    )
    stopped = time.monotonic()
    killed.communicate(timeout=180)
    assert killed.returncode != 0, "torchrun reported success after a rank was killed"
    assert time.monotonic() - stopped < 180
    assert (tmp_path / "b" / f"step_{2 * EVERY:08d}" / ".metadata").exists(), "".join(seen)[-3000:]

    must_say = _plant_what_resume_must_skip(tmp_path / "b")
    resumed = subprocess.run(
        _command("--checkpoint-dir", str(tmp_path / "b"), "--resume"),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for line in must_say:
        assert any(x.startswith(line) for x in resumed.stdout.splitlines()), (line, resumed.stdout[-3000:])

    want, got = _losses(straight[0]), _losses(resumed.stdout)
    after = list(range(2 * EVERY + 1, STEPS + 1))
    assert sorted(got) == after, got
    assert {s: want[s] for s in after} == got
    _assert_same_state(straight[1], tmp_path / "b", tmp_path)


def test_rank_killed_under_torchrun_restarts_ends_like_an_uninterrupted_one(
    tmp_path: Path, straight: tuple[str, Path]
) -> None:
    """Under `torchrun --max-restarts 3` with --resume --save-every K, rank 1 SIGKILLed after step 2K+1: torchrun
    restarts both workers in the same command, which exits 0; they resume from step 2K (at most K steps lost), log
    A's losses for the steps they replay and after, and end with A's weights, optimizer state and AUC. More than one
    restart is allowed because a restarted gloo group's first connect can be refused (seen here on a loaded box:
    "Gloo connectFullMesh failed ... Connection refused"); the next restart resumes the same way. (Without the
    per-attempt key prefix of jobs.init_distributed about one job in two never reconnected here: every restart read
    the dead attempt's addresses.)"""
    directory = tmp_path / "b"
    cmd = _command(
        "--checkpoint-dir", str(directory), "--save-every", str(EVERY), "--resume", torchrun=("--max-restarts", "3")
    )
    proc, seen = _start_and_kill(cmd, ranks=(1,), after=KILL_AFTER)
    rest, _ = proc.communicate(timeout=300)
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-4000:]
    restarted = out[len("".join(seen)) :]
    assert f"resumed from {checkpoint_path(directory, 2 * EVERY)} at step {2 * EVERY}" in restarted, out[-4000:]
    replayed = _losses(restarted)
    assert sorted(replayed) == list(range(2 * EVERY + 1, STEPS + 1)), replayed
    want = _losses(straight[0])
    assert {s: want[s] for s in replayed} == replayed
    assert _result(out)["auc"] == _result(straight[0])["auc"]
    _assert_same_state(straight[1], directory, tmp_path)


def _resumed_run(directory: Path, steps: int, nproc: int, plan_out: Path) -> str:
    """The example continued with --resume to `steps` on `nproc` ranks in nodes of 2 (simulated when nproc > 2),
    planning afresh for that world and writing its plan to plan_out; its output."""
    flags = ("--checkpoint-dir", str(directory), "--resume", "--steps", str(steps), "--plan-out", str(plan_out))
    cmd = _command(*ELASTIC_FLAGS, *flags, nproc=nproc)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _assert_continued(out: str, directory: Path, start: int, end: int, plan_out: Path, world: int) -> None:
    """A relaunch resumed from step `start` (the newest verified step), planned for `world` ranks in nodes of 2,
    trained exactly steps start+1..end and saved a final checkpoint that verifies."""
    assert f"resumed from {checkpoint_path(directory, start)} at step {start}" in out, out[-3000:]
    assert sorted(_losses(out)) == list(range(start + 1, end + 1)), _losses(out)
    result = _result(out)
    assert (result["world_size"], result["local_world_size"], result["steps_run"]) == (world, 2, end - start), result
    plan = json.loads(plan_out.read_text())
    assert (plan["world_size"], plan["local_world_size"]) == (world, 2)
    assert verify_checkpoint(checkpoint_path(directory, end)) == []


#: smaller batches for the elastic runs (4 ranks on a small CPU box), every rank's node of 2 ranks
ELASTIC_FLAGS = ("--batch-size", "128", "--eval-batches", "2", "--local-world-size", "2")


def test_lost_node_continues_on_fewer_ranks_and_grows_back(tmp_path: Path) -> None:
    """2 simulated nodes x 2 ranks save every K steps; node 1 (ranks 2 and 3) is SIGKILLed after step 2K+1, and
    torchrun stops the job. Relaunched on 1 node x 2 ranks with --resume, the example resumes from step 2K, the newest
    verified step, under a new plan for 2 ranks (the checkpoint is loaded across plans), and finishes at N; relaunched
    on 2 x 2 it resumes from N under a 4-rank plan and finishes at N + K."""
    directory = tmp_path / "ckpt"
    first = _command(*ELASTIC_FLAGS, "--checkpoint-dir", str(directory), "--save-every", str(EVERY), nproc=4)
    proc, seen = _start_and_kill(first, ranks=(2, 3), after=KILL_AFTER)
    proc.communicate(timeout=180)
    assert proc.returncode != 0, "torchrun reported success after a node was lost"
    assert verify_checkpoint(checkpoint_path(directory, 2 * EVERY)) == [], "".join(seen)[-3000:]

    shrunk = _resumed_run(directory, STEPS, 2, tmp_path / "plan2.json")
    _assert_continued(shrunk, directory, 2 * EVERY, STEPS, tmp_path / "plan2.json", 2)
    grown = _resumed_run(directory, STEPS + EVERY, 4, tmp_path / "plan4.json")
    _assert_continued(grown, directory, STEPS, STEPS + EVERY, tmp_path / "plan4.json", 4)
