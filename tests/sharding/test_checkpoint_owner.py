"""A checkpoint directory belongs to one run at a time (embark_torchrec.checkpoint's owner.lock): a second run that
saves into it is refused by name (the holder's pid, host and since when) before writing anything, however many try
at once; a holder whose process is gone is taken over; and what is published always verifies. Before, two runs into
one directory both exited 0, the second replacing the first's steps, and three processes saving the same steps ended
in a raw FileNotFoundError, a bare CheckpointException and a published step whose manifest named a missing file."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import embark_torchrec.checkpoint as ckpt
from embark_torchrec.checkpoint import CheckpointError, claim_checkpoint_directory, save_checkpoint, verify_checkpoint
from tests.support.processes import checkout_env

WAIT_S = 120.0

SAVE = """
import os, sys, time
from pathlib import Path
import torch
from embark_torchrec.checkpoint import CheckpointError, save_checkpoint
directory, ready, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.01)
try:
    for step in range(1, 5):
        save_checkpoint(directory, {"w": torch.full((256, 256), float(os.getpid())), "step": step}, step)
except CheckpointError as e:
    print(f"refused: {e}", flush=True)
    sys.exit(3)
print("saved", flush=True)
"""


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((8, 8), float(step)), "step": step}


def test_a_second_run_is_refused_naming_the_holder_and_a_gone_holder_is_taken_over(
    tmp_path: Path, checkpoint_holder: subprocess.Popen[str]
) -> None:
    directory = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as raised:
        save_checkpoint(directory, _state(1), 1)
    message = str(raised.value)
    for words in (
        "belongs to another run",
        f"pid {checkpoint_holder.pid} on host {socket.gethostname()}",
        "holding it since",
    ):
        assert words in message, message
    assert not ckpt.checkpoint_path(directory, 1).exists() and not (directory / "step_00000001.partial").exists()

    checkpoint_holder.send_signal(signal.SIGKILL)
    checkpoint_holder.wait()
    try:
        previous = claim_checkpoint_directory(directory)
        assert previous is not None and previous.pid == checkpoint_holder.pid, previous
        assert verify_checkpoint(save_checkpoint(directory, _state(1), 1)) == []
        assert claim_checkpoint_directory(directory) is None  # this process holds it already
    finally:
        ckpt.release_checkpoint_directory(directory)


def test_three_runs_saving_the_same_steps_at_once_one_saves_and_the_others_are_refused_by_name(
    tmp_path: Path,
) -> None:
    """Every published step verifies; exactly one process saved all its steps, the other two exit on a
    CheckpointError naming the winner's pid (no other exception)."""
    directory, go = tmp_path / "ckpt", tmp_path / "go"
    readies = [tmp_path / f"ready{i}" for i in range(3)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVE, str(directory), str(ready), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=checkout_env(),
        )
        for ready in readies
    ]
    try:
        deadline = time.monotonic() + WAIT_S
        while not all(r.exists() for r in readies) and time.monotonic() < deadline:
            time.sleep(0.05)
        go.touch()
        outputs = [p.communicate(timeout=WAIT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 3, 3], list(zip(codes, outputs))
    winner = procs[codes.index(0)].pid
    for code, (out, _) in zip(codes, outputs):
        if code == 3:
            assert "belongs to another run" in out and f"pid {winner} " in out, out
    published = sorted(p.name for p in directory.iterdir() if p.name.startswith("step_"))
    assert published == [f"step_{s:08d}" for s in range(1, 5)]
    for name in published:
        assert verify_checkpoint(directory / name) == [], name


def test_a_record_of_a_live_process_with_a_free_lock_is_refused_and_a_dead_one_taken_over(tmp_path: Path) -> None:
    """Where a file system grants the lock while owner.lock names a process still running on this host (locks not
    enforced), the claim is refused saying so; a record of a process that is gone is taken over."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = ckpt.Holder(sleeper.pid, socket.gethostname(), "sleeper", ckpt._process_started(sleeper.pid), 0.0)
        (directory / ckpt.OWNER_NAME).write_text(json.dumps(live._asdict()))
        with pytest.raises(CheckpointError, match=f"pid {sleeper.pid} .*still runs on this host.*not enforce"):
            claim_checkpoint_directory(directory)
    finally:
        sleeper.kill()
        sleeper.wait()
    try:
        assert claim_checkpoint_directory(directory) == live  # its process is gone now
    finally:
        ckpt.release_checkpoint_directory(directory)


def test_a_directory_removed_and_made_again_is_claimed_again_by_the_same_process(tmp_path: Path) -> None:
    """This process saved into a directory that was then removed (its lock file with it): the next save claims the
    new directory instead of trusting its stale record, and publishes a step that verifies."""
    directory = tmp_path / "ckpt"
    try:
        save_checkpoint(directory, _state(1), 1)
        shutil.rmtree(directory)
        assert verify_checkpoint(save_checkpoint(directory, _state(2), 2)) == []
        assert (directory / ckpt.OWNER_NAME).exists()
    finally:
        ckpt.release_checkpoint_directory(directory)
