"""The DLRM example at the edges of its checkpoint and output flags, under torchrun on 2 ranks:

* a --checkpoint-dir another live run holds stops this run on every rank before planning, naming the holder (two
  runs into one directory both exited 0, the second silently replacing the first's steps);
* a --checkpoint-dir that cannot be made, or a --plan-out that cannot be written, stops every rank before planning
  (they failed after planning or at the first save, on rank 0 alone, and the other rank reported gloo's
  "Connection closed by peer" first);
* --resume from a checkpoint past --steps says so, trains nothing and reports steps_run 0 (it reported -10);
* --resume over a step without a manifest and a stray step_abc names both and why, and starts at step 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


from embark_torchrec.checkpoint import OWNER_NAME, verify_checkpoint
from tests.support.processes import ROOT, checkout_env

TRAIN = ROOT / "examples" / "dlrm" / "train.py"
SMALL = ("--batch-size", "64", "--eval-batches", "1", "--log-every", "0", "--warmup-steps", "0")


def _torchrun(*flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=checkout_env(), cwd=ROOT, check=False)


def _stopped_before_planning(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    """The run failed on both ranks with every one of `words`, printed no plan, and no rank blamed gloo."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    for word in words:
        assert out.count(word) >= 2, (word, out[-3000:])  # said by both ranks
    assert "# embark plan" not in out and "Connection closed" not in out, out[-3000:]


def test_a_checkpoint_directory_another_run_holds_stops_every_rank_before_planning(
    tmp_path: Path, checkpoint_holder: subprocess.Popen[str]
) -> None:
    directory, pid = tmp_path / "ckpt", checkpoint_holder.pid
    proc = _torchrun("--steps", "2", "--checkpoint-dir", str(directory), *SMALL)
    _stopped_before_planning(proc, "belongs to another run", f"pid {pid} ")
    assert sorted(p.name for p in directory.iterdir()) == [OWNER_NAME]


def test_a_checkpoint_dir_that_cannot_be_made_stops_every_rank_before_planning(tmp_path: Path) -> None:
    """A --checkpoint-dir that is a file failed only at the first save, after planning and training."""
    taken = tmp_path / "a_file"
    taken.write_text("")
    proc = _torchrun("--steps", "2", "--checkpoint-dir", str(taken), *SMALL)
    _stopped_before_planning(proc, f"checkpoint directory {taken} cannot be made this run's")


def test_a_plan_out_that_cannot_be_written_stops_every_rank_before_planning(tmp_path: Path) -> None:
    proc = _torchrun("--steps", "2", "--plan-out", str(tmp_path / "missing" / "plan.json"), *SMALL)
    _stopped_before_planning(proc, "--plan-out", "does not exist")
    proc = _torchrun("--steps", "2", "--plan-out", str(tmp_path), *SMALL)
    _stopped_before_planning(proc, "--plan-out", "is a directory")


def test_resume_past_steps_says_so_trains_nothing_and_reports_zero_steps_run(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    first = _torchrun("--steps", "3", "--checkpoint-dir", str(directory), *SMALL)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    proc = _torchrun("--steps", "1", "--resume", "--checkpoint-dir", str(directory), *SMALL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the checkpoint's step 3 is at or past --steps 1: nothing to train" in proc.stdout, proc.stdout[-3000:]
    results = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1 and (results[0]["steps"], results[0]["steps_run"]) == (1, 0), results
    assert sorted(p.name for p in directory.iterdir() if p.name != OWNER_NAME) == ["step_00000003"]


def test_example_resume_reports_what_it_skips_and_saves_verified_steps(tmp_path: Path) -> None:
    """--resume over a directory holding only a step folder without a manifest (e.g. saved by an older version) and a
    stray step_abc: rank 0 names both with their reasons, training starts at step 0 instead of crashing, and the
    step the run saves verifies."""
    ckpt_dir = tmp_path / "ckpt"
    (ckpt_dir / "step_abc").mkdir(parents=True)
    (ckpt_dir / "step_00000007").mkdir()
    (ckpt_dir / "step_00000007" / ".metadata").write_bytes(b"junk")
    proc = _torchrun(
        "--steps", "2", "--batch-size", "64", "--eval-batches", "1", "--log-every", "1",
        "--checkpoint-dir", str(ckpt_dir), "--resume",
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    lines = out.splitlines()
    assert f"skipped checkpoint {ckpt_dir / 'step_00000007'}: no manifest: " in "\n".join(lines), out[-3000:]
    assert f"skipped checkpoint {ckpt_dir / 'step_abc'}: name is not step_<int>" in lines, out[-3000:]
    assert f"no checkpoint in {ckpt_dir} verifies: starting at step 0" in lines
    assert not any(line.startswith("resumed from") for line in lines)
    assert json.loads(next(x for x in lines if x.startswith("RESULT "))[len("RESULT ") :])["steps_run"] == 2
    assert verify_checkpoint(ckpt_dir / "step_00000002") == []
