"""Kill and resume: a run whose rank is SIGKILLed and resumed from its last checkpoint ends where an
uninterrupted run ends.

The DLRM example runs three times under torchrun on 2 CPU ranks: (A) N steps straight; (B) the same, saving every
K steps, with rank 1 killed by SIGKILL after step 2K+1 has been logged (torchrun must then stop the job, no hang);
(C) B resumed with --resume. Before C, B's directory gets what resume must fall back from: a newest step N of another
model (it verifies; DCP cannot load it), steps 2K+2 and 2K+1 with a manifest nested too deep to parse and one with a
5,000-digit number, and step 2K left as a re-save that stopped between its two renames (its only verified copy is
step_<2K>.replaced). C must name each of them, resume at step 2K from the .replaced copy, log the same losses as A
for every step after it, and end with the same weights and optimizer state as A, bit for bit (both final checkpoints,
read back with torch.distributed.checkpoint's single-process reader; C's final save replaces the foreign step N).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from embark_torchrec.checkpoint import MANIFEST_NAME, checkpoint_path, release_checkpoint_directory, save_checkpoint
from embark_torchrec.testing.checkpoints import HOSTILE_MANIFESTS, leave_rename_window

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "dlrm" / "train.py"
STEPS, EVERY = 12, 4
KILL_AFTER = 2 * EVERY + 1  # killed after this step is logged: the last checkpoint is at 2K


def _command(*extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN),
        "--steps", str(STEPS), "--log-every", "1", "--seed", "3", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def _losses(out: str) -> dict[int, str]:
    """Logged mean loss per step ("step 9: loss 0.6931, ..."), as printed."""
    found = {}
    for line in out.splitlines():
        if line.startswith("step ") and ": loss " in line:
            head, rest = line.split(": loss ", 1)
            found[int(head.split()[1])] = rest.split(",")[0]
    return found


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


def test_killed_and_resumed_run_ends_like_an_uninterrupted_one(tmp_path: Path) -> None:
    """Same losses after the checkpoint, same final weights and optimizer state, and no hang when a rank dies; resume
    names each newer step it cannot use and loads the only verified copy of the last good one."""
    straight = subprocess.Popen(  # runs alongside the run that gets killed
        _command("--checkpoint-dir", str(tmp_path / "a")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    killed = subprocess.Popen(
        _command("--checkpoint-dir", str(tmp_path / "b"), "--save-every", str(EVERY)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
    )  # fmt: skip
    seen = []
    assert killed.stdout is not None
    for line in killed.stdout:
        seen.append(line)
        if line.startswith(f"step {KILL_AFTER}: loss"):
            os.kill(_worker_of_rank(killed.pid, 1), signal.SIGKILL)
            break
    stopped = time.monotonic()
    killed.communicate(timeout=180)
    assert killed.returncode != 0, "torchrun reported success after a rank was killed"
    assert time.monotonic() - stopped < 180
    assert (tmp_path / "b" / f"step_{2 * EVERY:08d}" / ".metadata").exists(), "".join(seen)[-3000:]
    straight_out, straight_err = straight.communicate(timeout=300)
    assert straight.returncode == 0, straight_out[-3000:] + straight_err[-3000:]

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

    want, got = _losses(straight_out), _losses(resumed.stdout)
    after = list(range(2 * EVERY + 1, STEPS + 1))
    assert sorted(got) == after, got
    assert {s: want[s] for s in after} == got

    a, b = _final_state(tmp_path / "a", tmp_path), _final_state(tmp_path / "b", tmp_path)
    assert sorted(a) == sorted(b) and any("embedding_bags" in k for k in a), sorted(a)[:10]
    for key in a:
        assert torch.equal(a[key], b[key]), key
