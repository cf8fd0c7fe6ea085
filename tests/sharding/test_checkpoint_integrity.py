"""Checkpoints you can trust (embark_torchrec.checkpoint): a damaged or unfinished newest step is never loaded.

Each save gets a manifest (size and SHA-256 of every file) and becomes visible as step_<n> only once complete; resume
takes the newest step whose files match it. The damages: 4 KiB of a data file flipped in place (same size), a
truncated data file, a deleted data or metadata file, no manifest, a garbled manifest, an extra file, a folder renamed
to another step, a stray step_abc folder, a save that stopped after DCP wrote its files; then what resume must always
fall back from: a manifest of any content (support/checkpoints.py's HOSTILE_MANIFESTS: nesting deeper than the JSON
parser's stack, 5,000-digit numbers, JSON that is not a table, wrong types, binary junk, too large, a link, a FIFO,
names outside the folder), a step of another model that verifies but DCP cannot load, an exception of any class from
DCP, a load that fails after writing part of the state, and a re-save that stopped between its two renames. In each
case resume must load the newest step that verifies and loads, bit for bit (compared with the state saved at that
step), and name each skipped folder and the reason. In process on a 1-rank gloo group (the helpers' broadcast paths
run), then on 2 ranks (every rank loads the step rank 0 chose; a failure on rank 0 reaches rank 1; a read error on
rank 1 alone makes both fall back). The DLRM example's --resume over damaged steps is in
tests/e2e/test_example_dlrm_edges.py.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import subprocess
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, filesystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import embark_torchrec.checkpoint as ckpt
from embark_torchrec import (
    CheckpointError,
    latest_verified_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from embark_torchrec.testing import run_ranks
from tests.support.checkpoints import HOSTILE_MANIFESTS, leave_rename_window, stopped_between_renames

ROOT = Path(__file__).resolve().parents[2]
STEPS = (4, 8, 12)
DATA = "__0_0.distcp"


def _state(step: int) -> dict[str, Any]:
    """A training state that differs at every step: weights, optimizer state, a plain value, the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g).double()},
        "optimizer": {"sum": torch.rand(64, 64, generator=g), "lr": 0.01 * step},
        "step": torch.tensor(step),
    }


def _blank() -> dict[str, Any]:
    """What a fresh trainer holds before loading: the same structure, other values."""
    return {
        "model": {"w": torch.zeros(64, 64), "b": torch.zeros(64, dtype=torch.float64)},
        "optimizer": {"sum": torch.zeros(64, 64), "lr": 0.0},
        "step": torch.tensor(0),
    }


def _assert_bit_equal(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for key in want:
            _assert_bit_equal(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    else:
        assert got == want, where


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def saved(tmp_path: Path, one_rank: None) -> Path:
    """A checkpoint directory with steps 4, 8 and 12 saved by save_checkpoint."""
    for step in STEPS:
        save_checkpoint(tmp_path, _state(step), step)
    return tmp_path


# ---------------------------------------------------------------- damages: (damage, expected step, folder, words)


def _flip(folder: Path) -> None:
    data = folder / "step_00000012" / DATA
    size = data.stat().st_size
    assert size > 3 * 4096
    with open(data, "r+b") as fh:  # bytes 4-8 KiB: inside the first tensor's raw data
        fh.seek(4096)
        block = fh.read(4096)
        fh.seek(4096)
        fh.write(bytes(b ^ 0xFF for b in block))
    assert data.stat().st_size == size


def _truncate(folder: Path) -> None:
    data = folder / "step_00000012" / DATA
    os.truncate(data, data.stat().st_size // 2)


def _garble_manifest(folder: Path) -> None:
    manifest = folder / "step_00000012" / ckpt.MANIFEST_NAME
    manifest.write_text(manifest.read_text()[:-20])


def _rename_to_16(folder: Path) -> None:
    (folder / "step_00000004").rename(folder / "step_00000016")


def _stray(folder: Path) -> None:
    (folder / "step_abc").mkdir()
    (folder / "step_abc" / ".metadata").write_bytes(b"not a checkpoint")


DAMAGES: dict[str, tuple[Callable[[Path], None], int, str, list[str]]] = {
    "flipped_same_size": (_flip, 8, "step_00000012", ["hash mismatch", f"step_00000012/{DATA}"]),
    "truncated": (_truncate, 8, "step_00000012", ["size differs", f"step_00000012/{DATA}"]),
    "data_file_deleted": (
        lambda f: (f / "step_00000012" / DATA).unlink(),
        8,
        "step_00000012",
        ["missing file", f"step_00000012/{DATA}"],
    ),
    "metadata_deleted": (
        lambda f: (f / "step_00000012" / ".metadata").unlink(),
        8,
        "step_00000012",
        ["missing file", "step_00000012/.metadata"],
    ),
    "no_manifest": (
        lambda f: (f / "step_00000012" / ckpt.MANIFEST_NAME).unlink(),
        8,
        "step_00000012",
        ["no manifest", f"step_00000012/{ckpt.MANIFEST_NAME}"],
    ),
    "garbled_manifest": (_garble_manifest, 8, "step_00000012", ["unreadable", ckpt.MANIFEST_NAME]),
    "extra_file": (
        lambda f: (f / "step_00000012" / "__2_0.distcp").write_bytes(b"x"),
        8,
        "step_00000012",
        ["unexpected file", "step_00000012/__2_0.distcp"],
    ),
    "renamed_to_another_step": (_rename_to_16, 12, "step_00000016", ["says step 4", "folder name says step 16"]),
    "stray_step_abc": (_stray, 12, "step_abc", ["name is not step_<int>"]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_resume_skips_a_damaged_newest_step_and_loads_the_newest_intact_one_bit_for_bit(
    saved: Path, damage: str
) -> None:
    """After the damage, resume loads the newest step that is intact (not the damaged one: every step's state
    differs), bit for bit as saved, and reports the damaged folder with the reason and the file."""
    apply, want_step, bad_folder, words = DAMAGES[damage]
    apply(saved)
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert (resumed.path, resumed.step) == (saved / f"step_{want_step:08d}", want_step), resumed
    _assert_bit_equal(state, _state(want_step))
    assert [s.path for s in resumed.skipped] == [saved / bad_folder], resumed.skipped
    reason = resumed.skipped[0].reason
    assert all(w in reason for w in words), reason
    assert latest_verified_checkpoint(saved) == (resumed.path, resumed.skipped)


def test_damage_in_every_newer_step_is_reported_newest_first(saved: Path) -> None:
    """Two damaged steps: both are named, newest first, and resume falls back past both."""
    _flip(saved)
    (saved / "step_00000008" / ".metadata").unlink()
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert resumed.step == 4
    _assert_bit_equal(state, _state(4))
    assert [(s.path.name, s.reason.split(" ")[0]) for s in resumed.skipped] == [
        ("step_00000012", "hash"),
        ("step_00000008", "missing"),
    ]


def test_save_writes_a_manifest_of_every_file_and_leaves_only_the_step_folder(saved: Path) -> None:
    """Each step folder holds DCP's files and a manifest with the size and SHA-256 of each of them (recomputed here);
    no temporary folder or file is left after a save."""
    assert sorted(p.name for p in saved.iterdir() if p.name != ckpt.OWNER_NAME) == [f"step_{s:08d}" for s in STEPS]
    folder = saved / "step_00000008"
    manifest = json.loads((folder / ckpt.MANIFEST_NAME).read_text())
    files = sorted(p.name for p in folder.iterdir() if p.name != ckpt.MANIFEST_NAME)
    assert files == [".metadata", DATA]
    assert manifest["step"] == 8
    assert manifest["files"] == {
        name: {
            "size": (folder / name).stat().st_size,
            "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
        }
        for name in files
    }
    assert verify_checkpoint(folder) == []


def test_a_save_that_stops_before_its_manifest_never_shows_as_a_step(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP finished writing but the save died before the manifest: no step_00000016 exists, resume reports the
    leftover as an unfinished save and loads step 12; the next save of step 16 replaces the leftover."""
    real_save = ckpt.dcp.save

    def save_then_die(state: dict[str, Any], **kwargs: Any) -> None:
        real_save(state, **kwargs)
        raise OSError("disk gone")

    monkeypatch.setattr(ckpt.dcp, "save", save_then_die)
    with pytest.raises(CheckpointError, match="step_00000016.partial.*disk gone"):
        save_checkpoint(saved, _state(16), 16)
    monkeypatch.setattr(ckpt.dcp, "save", real_save)
    assert not (saved / "step_00000016").exists() and (saved / "step_00000016.partial" / ".metadata").exists()
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert resumed.step == 12
    _assert_bit_equal(state, _state(12))
    assert [(s.path.name, s.reason.split(" ")[0]) for s in resumed.skipped] == [("step_00000016.partial", "unfinished")]

    save_checkpoint(saved, _state(16), 16)
    assert not (saved / "step_00000016.partial").exists()
    state = _blank()
    assert resume_checkpoint(saved, state).skipped == []
    _assert_bit_equal(state, _state(16))


def test_saving_a_step_again_replaces_it_whole(saved: Path) -> None:
    """A second save of step 12 (a rerun into the same directory) leaves one verified step_00000012 with the new
    state, and nothing else behind."""
    newer = _state(99)
    save_checkpoint(saved, newer, 12)
    assert sorted(p.name for p in saved.iterdir() if p.name != ckpt.OWNER_NAME) == [f"step_{s:08d}" for s in STEPS]
    state = _blank()
    assert resume_checkpoint(saved, state).step == 12
    _assert_bit_equal(state, newer)


def test_load_checkpoint_refuses_a_damaged_step_that_dcp_alone_would_load(saved: Path) -> None:
    """The flipped step loads without an error when not verified (DCP checks no hashes), into values that differ
    from the save; verified, it raises naming the file, and leaves the target untouched."""
    _flip(saved)
    path = saved / "step_00000012"
    unchecked = _blank()
    load_checkpoint(path, unchecked, verify=False)
    assert unchecked["step"] == 12 and not torch.equal(unchecked["model"]["w"], _state(12)["model"]["w"])
    state = _blank()
    with pytest.raises(CheckpointError, match=f"hash mismatch on file .*step_00000012/{DATA}"):
        load_checkpoint(path, state)
    _assert_bit_equal(state, _blank())
    load_checkpoint(saved / "step_00000008", state)
    _assert_bit_equal(state, _state(8))


def test_nothing_to_resume_and_a_bad_directory(tmp_path: Path, one_rank: None) -> None:
    """A missing or empty directory resumes nothing (a fresh run); a file in its place is an error naming it; a
    negative step is refused, naming the directory."""
    state = _blank()
    assert resume_checkpoint(tmp_path / "none", state) == (None, None, [])
    assert resume_checkpoint(tmp_path, state) == (None, None, [])
    _assert_bit_equal(state, _blank())
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="file is not a folder"):
        resume_checkpoint(tmp_path / "file", state)
    with pytest.raises(ValueError, match=f"-1 .*{tmp_path.name}"):
        save_checkpoint(tmp_path, state, -1)


@pytest.mark.parametrize("target", ["gone", "loop"])
def test_a_checkpoint_directory_linked_to_nothing_is_an_error_not_a_fresh_start(
    tmp_path: Path, one_rank: None, target: str
) -> None:
    """A symbolic link to a missing folder (an unmounted share) or to itself does not exist to Path.exists(); a
    fresh start there would train from step 0 beside the checkpoints the link was meant to reach."""
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "unmounted" if target == "gone" else link)
    with pytest.raises(CheckpointError, match="ckpt is a symbolic link to nothing"):
        resume_checkpoint(link, _blank())
    with pytest.raises(CheckpointError, match="symbolic link to nothing"):
        latest_verified_checkpoint(link)


# ---------------------------------------------------------------- what resume must always fall back from


def _steps_skipped(resumed: ckpt.Resumed) -> list[str]:
    return [s.path.name for s in resumed.skipped]


@pytest.mark.parametrize("hostile", sorted(HOSTILE_MANIFESTS))
def test_resume_skips_a_hostile_manifest_by_name_and_loads_the_older_step(saved: Path, hostile: str) -> None:
    """Whatever step 12's manifest holds (or whatever it names), resume never raises: it loads step 8 bit for bit and
    names step_00000012 with a reason that says what is wrong, in a few hundred characters at most."""
    damage, words = HOSTILE_MANIFESTS[hostile]
    damage(saved / "step_00000012")
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert (resumed.path, resumed.step) == (saved / "step_00000008", 8), resumed
    _assert_bit_equal(state, _state(8))
    assert _steps_skipped(resumed) == ["step_00000012"], resumed.skipped
    reason = resumed.skipped[0].reason
    assert all(w in reason for w in words) and "step_00000012" in reason, reason
    assert len(reason) < 1000, reason[:2000]
    assert "; ".join(verify_checkpoint(saved / "step_00000012")) == reason


def test_when_no_step_verifies_every_step_is_named_and_nothing_is_loaded(saved: Path) -> None:
    """Three hostile manifests: a fresh start (path None, the state untouched) that names each step, newest first,
    with its own reason."""
    hostile = {12: "deeply_nested_json", 8: "5000_digit_size", 4: "symbolic_link"}
    for step, name in hostile.items():
        HOSTILE_MANIFESTS[name][0](saved / f"step_{step:08d}")
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert (resumed.path, resumed.step) == (None, None)
    _assert_bit_equal(state, _blank())
    assert _steps_skipped(resumed) == [f"step_{s:08d}" for s in hostile]
    for skip, name in zip(resumed.skipped, hostile.values(), strict=True):
        assert all(w in skip.reason for w in HOSTILE_MANIFESTS[name][1]), skip


ANOTHER_MODEL = {
    "other_keys": ({"model": {"emb": torch.zeros(8, 4)}, "step": torch.tensor(16)}, "Missing key"),
    "other_shapes": ({**_state(16), "model": {"w": torch.zeros(32, 64), "b": torch.zeros(64)}}, "Size mismatch"),
}


@pytest.mark.parametrize("other", sorted(ANOTHER_MODEL))
def test_a_newest_step_of_another_model_is_skipped_by_name(saved: Path, other: str) -> None:
    """Step 16 was saved (and verifies) by another model: DCP raises its CheckpointException (a BaseException) while
    planning; resume names step_00000016 with DCP's reason and loads step 12 bit for bit; load_checkpoint of step 16
    raises CheckpointError naming the folder."""
    state_16, words = ANOTHER_MODEL[other]
    save_checkpoint(saved, state_16, 16)
    assert verify_checkpoint(saved / "step_00000016") == []
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert resumed.step == 12
    _assert_bit_equal(state, _state(12))
    assert _steps_skipped(resumed) == ["step_00000016"]
    reason = resumed.skipped[0].reason
    assert f"DCP could not load {saved / 'step_00000016'}" in reason and words in reason, reason
    with pytest.raises(CheckpointError, match=f"loading .*step_00000016 failed: .*{words}"):
        load_checkpoint(saved / "step_00000016", _blank())


class _Unusual(BaseException):
    """An exception class outside Exception, as DCP's CheckpointException is."""


def test_an_exception_of_any_class_from_dcp_falls_back(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dcp.load raising a BaseException subclass on step 12: resume names the class and the folder and loads step 8;
    a KeyboardInterrupt is not swallowed."""
    real = ckpt.dcp.load

    def load(state: dict[str, Any], *, checkpoint_id: Path, **kwargs: Any) -> None:
        if Path(checkpoint_id).name == "step_00000012":
            raise _Unusual("from outside Exception")
        real(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "load", load)
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert resumed.step == 8
    _assert_bit_equal(state, _state(8))
    assert resumed.skipped == [
        ckpt.Skipped(
            saved / "step_00000012",
            f"DCP could not load {saved / 'step_00000012'} into this state: _Unusual: from outside Exception",
        )
    ]

    def interrupted(state: dict[str, Any], **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.dcp, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resume_checkpoint(saved, _blank())


# ---------------------------------------------------------------- failed saves: a named error, nothing published


def _unpublished(saved: Path, step: int) -> None:
    """The failed save of `step` left no step folder, and resume still loads step 12 bit for bit."""
    assert not ckpt.checkpoint_path(saved, step).exists()
    state = _blank()
    assert resume_checkpoint(saved, state).step == 12
    _assert_bit_equal(state, _state(12))


def _disk_full_in_dcp(state: dict[str, Any], *, checkpoint_id: Path, **kwargs: Any) -> None:
    """DCP as it fails on a full disk: some files written, then its CheckpointException (a BaseException) carrying
    torch.save's error, raised from the OSError of the write."""
    Path(checkpoint_id).mkdir()
    (Path(checkpoint_id) / DATA).write_bytes(b"\0" * 100)
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as full:
        inner = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        inner.__cause__ = full
    raise CheckpointException("ranks:dict_keys([0])", {0: (inner, traceback.StackSummary())})


def test_a_full_disk_in_dcp_is_a_named_error_with_folder_step_and_cause(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's CheckpointException (a BaseException, which `except Exception` let through bare) becomes CheckpointError
    naming the directory, the step and the cause (no space left), and no step_00000016 is published."""
    monkeypatch.setattr(ckpt.dcp, "save", _disk_full_in_dcp)
    with pytest.raises(CheckpointError) as raised:
        save_checkpoint(saved, _state(16), 16)
    message = str(raised.value)
    for words in (
        f"saving step 16 into {saved} failed",
        "no space left on the device",
        "unexpected pos",
        "not published",
    ):
        assert words in message, message
    _unpublished(saved, 16)


@pytest.mark.parametrize(
    "where, code, words",
    [
        ("manifest", errno.EDQUOT, "disk quota exceeded"),
        ("manifest", errno.EIO, "input/output error"),
        ("rename", errno.EACCES, "permission denied"),
        ("clear", errno.EROFS, "read-only file system"),
    ],
)
def test_a_file_system_error_anywhere_in_a_save_is_a_named_error(
    saved: Path, monkeypatch: pytest.MonkeyPatch, where: str, code: int, words: str
) -> None:
    """Writing the manifest, renaming the finished folder, removing an earlier unfinished one: an OSError in any of
    them was raised bare (on rank 0 only); now it is a CheckpointError with the folder, the step and its meaning,
    and the step is not published."""
    failure = OSError(code, os.strerror(code))

    def fail(*args: Any, **kwargs: Any) -> None:
        raise failure

    if where == "manifest":
        monkeypatch.setattr(ckpt, "_write_manifest", fail)
    elif where == "rename":
        real_replace = os.replace
        monkeypatch.setattr(
            ckpt.os, "replace", lambda src, dst: fail() if str(src).endswith(".partial") else real_replace(src, dst)
        )
    else:
        (saved / "step_00000016.partial").mkdir()
        monkeypatch.setattr(ckpt, "_clear", fail)
    with pytest.raises(CheckpointError) as raised:
        save_checkpoint(saved, _state(16), 16)
    message = str(raised.value)
    assert f"saving step 16 into {saved} failed" in message and words in message, message
    monkeypatch.undo()
    _unpublished(saved, 16)


def test_an_exception_of_any_class_from_dcp_while_saving_is_a_named_error(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BaseException subclass out of dcp.save becomes CheckpointError naming its class; KeyboardInterrupt passes."""

    def unusual(state: dict[str, Any], **kwargs: Any) -> None:
        raise _Unusual("from outside Exception")

    monkeypatch.setattr(ckpt.dcp, "save", unusual)
    with pytest.raises(CheckpointError, match="saving step 16 .* failed: DCP failed writing .*_Unusual: from outside"):
        save_checkpoint(saved, _state(16), 16)
    _unpublished(saved, 16)

    def interrupted(state: dict[str, Any], **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.dcp, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(saved, _state(16), 16)


def test_an_unwritable_checkpoint_directory_is_a_named_error(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory that cannot be made (permission denied; simulated, as root may write anywhere) or a file in its
    place: CheckpointError naming it, before DCP writes anything."""
    target = tmp_path / "ckpt"

    def denied(self: Path, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(CheckpointError, match=f"saving step 1 into {target} failed: .*{target}.*permission denied"):
        save_checkpoint(target, _state(1), 1)
    monkeypatch.undo()
    target.write_text("not a folder")
    with pytest.raises(CheckpointError, match=f"saving step 1 into {target} failed: .*{target}"):
        save_checkpoint(target, _state(1), 1)


def test_a_really_full_disk_is_named_and_the_older_step_still_resumes(tmp_path: Path, one_rank: None) -> None:
    """On a 2 MiB tmpfs (mounted where this test may: as root, else skipped), a small step saves and a 4 MiB one
    fails: CheckpointError naming the step, the folder and a full file system (torch.save's own words were only
    "unexpected pos"), and resume loads the small step."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = shutil.which("mount") is not None and (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], capture_output=True).returncode
        == 0
    )
    if not mounted:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    directory = small / "ckpt"
    try:
        save_checkpoint(directory, _state(1), 1)
        with pytest.raises(CheckpointError) as raised:
            save_checkpoint(directory, {**_state(2), "big": torch.randn(1 << 20)}, 2)
        message = str(raised.value)
        assert f"saving step 2 into {directory} failed" in message and "full" in message, message
        assert not ckpt.checkpoint_path(directory, 2).exists()
        state = _blank()
        assert resume_checkpoint(directory, state).step == 1
        _assert_bit_equal(state, _state(1))
    finally:
        ckpt.release_checkpoint_directory(directory)  # its open lock file would keep the mount busy
        subprocess.run(["umount", str(small)], check=True)


def _files_vanish_before_publishing(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = ckpt._write_manifest

    def write_then_lose_metadata(folder: Path, step: int) -> dict[str, int]:
        files = real(folder, step)
        (folder / ".metadata").unlink()  # what a concurrent writer clearing the same .partial did
        return files

    monkeypatch.setattr(ckpt, "_write_manifest", write_then_lose_metadata)


def test_a_step_whose_files_change_before_it_is_published_is_not_published(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file removed between the manifest and the rename (a concurrent writer did it; verify would reject the step
    at resume): the save refuses to publish it, by name."""
    _files_vanish_before_publishing(saved, monkeypatch)
    with pytest.raises(CheckpointError, match="saving step 16 .* changed while it was saved .*metadata"):
        save_checkpoint(saved, _state(16), 16)
    monkeypatch.undo()
    _unpublished(saved, 16)


def test_a_step_is_not_published_once_another_run_replaced_the_lock(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """owner.lock removed and made again while the save ran (another run taking the directory over): the save
    refuses to publish, naming the lock, instead of racing the other run's saves."""
    real = ckpt._write_manifest

    def write_then_lose_the_lock(folder: Path, step: int) -> dict[str, int]:
        (saved / ckpt.OWNER_NAME).unlink()
        (saved / ckpt.OWNER_NAME).write_text("")
        return real(folder, step)

    monkeypatch.setattr(ckpt, "_write_manifest", write_then_lose_the_lock)
    with pytest.raises(
        CheckpointError, match=f"saving step 16 .*{ckpt.OWNER_NAME}, which this run locked, was removed"
    ):
        save_checkpoint(saved, _state(16), 16)
    monkeypatch.undo()
    _unpublished(saved, 16)
    ckpt.release_checkpoint_directory(saved)


def _read_one_item_then_fail(failing: set[str]) -> Callable[..., Any]:
    """FileSystemReader.read_data that, in the folders named in `failing`, reads the first item of its plan (writing it
    into the state) and then fails: a read error half-way through a load."""
    real = FileSystemReader.read_data

    def read_data(self: FileSystemReader, plan: LoadPlan, planner: LoadPlanner) -> Any:
        if Path(self.path).name in failing:
            real(self, dataclasses.replace(plan, items=plan.items[:1]), planner).wait()
            raise OSError(f"I/O error reading {self.path}")
        return real(self, plan, planner)

    return read_data


def test_a_load_that_fails_half_way_falls_back_and_the_older_step_overwrites_all_of_it(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 12's read fails after writing part of it into the state: step 8 loads over every value, bit for bit."""
    monkeypatch.setattr(FileSystemReader, "read_data", _read_one_item_then_fail({"step_00000012"}))
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert resumed.step == 8 and _steps_skipped(resumed) == ["step_00000012"]
    assert "OSError: I/O error reading" in resumed.skipped[0].reason
    _assert_bit_equal(state, _state(8))


def test_when_no_step_loads_after_one_wrote_into_the_state_resume_raises_naming_every_step(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every load fails half-way: the state is no longer a fresh one, so resume raises instead of starting over,
    naming every step and why; when no load wrote anything (another model's steps only) it is a fresh start."""
    monkeypatch.setattr(FileSystemReader, "read_data", _read_one_item_then_fail({f"step_{s:08d}" for s in STEPS}))
    with pytest.raises(CheckpointError) as raised:
        resume_checkpoint(saved, _blank())
    message = str(raised.value)
    assert "wrote part of it into the state" in message, message
    assert all(f"{saved / f'step_{s:08d}'}: DCP could not load" in message for s in STEPS), message

    state = {"other": torch.zeros(3)}
    resumed = resume_checkpoint(saved, state)
    assert (resumed.path, resumed.step) == (None, None) and torch.equal(state["other"], torch.zeros(3))
    assert _steps_skipped(resumed) == [f"step_{s:08d}" for s in reversed(STEPS)]
    assert all("Missing key" in s.reason for s in resumed.skipped), resumed.skipped


def test_a_resave_stopped_between_its_two_renames_resumes_from_the_only_verified_copy(saved: Path) -> None:
    """Re-saving step 12 stops after step_00000012 became step_00000012.replaced, before the new save (.partial)
    became step_00000012: resume loads the .replaced copy as step 12, bit for bit, and reports the .partial; the
    next save of step 12 leaves only step_00000012. leave_rename_window leaves the same folders."""
    with stopped_between_renames(), pytest.raises(CheckpointError, match="renaming .*stopped before renaming"):
        save_checkpoint(saved, _state(99), 12)
    names = sorted(p.name for p in saved.iterdir() if p.name != ckpt.OWNER_NAME)
    assert names == ["step_00000004", "step_00000008", "step_00000012.partial", "step_00000012.replaced"]
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert (resumed.path, resumed.step) == (saved / "step_00000012.replaced", 12), resumed
    _assert_bit_equal(state, _state(12))
    assert [(s.path.name, s.reason.split(" ")[0]) for s in resumed.skipped] == [("step_00000012.partial", "unfinished")]

    save_checkpoint(saved, _state(99), 12)
    assert sorted(p.name for p in saved.iterdir() if p.name != ckpt.OWNER_NAME) == [f"step_{s:08d}" for s in STEPS]
    assert leave_rename_window(saved, 12) == saved / "step_00000012.replaced"
    assert sorted(p.name for p in saved.iterdir() if p.name != ckpt.OWNER_NAME) == names


def test_a_damaged_or_stale_replaced_copy_is_named(saved: Path) -> None:
    """A damaged step_00000012.replaced (no step_00000012) is skipped by name for step 8; a stale .replaced beside a
    good step_00000012 is reported as left behind, and step_00000012 loads."""
    (saved / "step_00000012").rename(saved / "step_00000012.replaced")
    HOSTILE_MANIFESTS["deeply_nested_json"][0](saved / "step_00000012.replaced")
    state = _blank()
    resumed = resume_checkpoint(saved, state)
    assert resumed.step == 8 and _steps_skipped(resumed) == ["step_00000012.replaced"]
    assert "RecursionError" in resumed.skipped[0].reason
    _assert_bit_equal(state, _state(8))

    save_checkpoint(saved, _state(12), 12)
    (saved / "step_00000008").rename(saved / "step_00000012.replaced")
    resumed = resume_checkpoint(saved, state)
    assert resumed.step == 12
    _assert_bit_equal(state, _state(12))
    assert [(s.path.name, s.reason.split(" ")[:3]) for s in resumed.skipped] == [
        ("step_00000012.replaced", ["an", "older", "save"])
    ]


# ---------------------------------------------------------------- 2 ranks


def _two_ranks(directory: str) -> dict[str, Any]:
    """Save steps 1 and 2 of a row-sharded tensor (each rank writes its own file); rank 0 flips rank 1's file of
    step 2; resume on both ranks. Then a save whose files rank 0 cannot see (as without a shared file system)."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def state(step: int) -> dict[str, Any]:
        full = torch.randn(256, 64, generator=torch.Generator().manual_seed(step))
        return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": torch.tensor(step)}

    for step in (1, 2):
        save_checkpoint(directory, state(step), step)
    files = sorted(p.name for p in (Path(directory) / "step_00000002").iterdir())
    if rank == 0:
        data = Path(directory) / "step_00000002" / "__1_0.distcp"
        with open(data, "r+b") as fh:
            fh.seek(100)
            fh.write(b"\xff" * 64)
    dist.barrier()
    target = state(0)
    resumed = resume_checkpoint(directory, target)
    assert isinstance(target["w"], DTensor)
    equal = torch.equal(target["w"].to_local(), state(1)["w"].to_local()) and int(target["step"]) == 1

    if rank == 1:  # rank 1 reports a file rank 0 does not have
        real = ckpt._listing
        ckpt._listing = lambda folder: [*real(folder), "__1_9.distcp"]
    try:
        save_checkpoint(directory, state(3), 3)
        error = ""
    except CheckpointError as e:
        error = str(e)
    return {"files": files, "resumed": resumed, "equal": equal, "error": error}


def test_two_ranks_load_the_step_rank_0_chose_and_share_its_errors(tmp_path: Path) -> None:
    """Each rank wrote its own data file; rank 1's file of step 2 is damaged: both ranks resume from step 1 with their
    own shard bit for bit and get the same skip report. A save whose files rank 0 cannot see fails on both ranks
    (none hangs), saying the directory must be shared, and leaves no step_00000003."""
    results = run_ranks(_two_ranks, 2, timeout_s=120, args=(str(tmp_path),))
    assert results[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", ckpt.MANIFEST_NAME]
    for r in results:
        assert r["equal"]
        assert (r["resumed"].path, r["resumed"].step) == (tmp_path / "step_00000001", 1)
        assert r["resumed"].skipped == results[0]["resumed"].skipped
        assert "hash mismatch" in r["resumed"].skipped[0].reason and "__1_0.distcp" in r["resumed"].skipped[0].reason
        assert "__1_9.distcp" in r["error"] and "every rank shares" in r["error"], r["error"]
    assert "(on rank 0)" in results[1]["error"]
    assert not (tmp_path / "step_00000003").exists()


def _two_ranks_fall_back(directory: str) -> dict[str, Any]:
    """Steps 1 and 2 of a row-sharded tensor "w", then step 3 of another model (its tensor is "v"); rank 1 alone fails
    to read step 2, after rank 0 read its shard of it; resume on both. Then resume a third model, which no step fits."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def state(step: int, key: str = "w") -> dict[str, Any]:
        full = torch.randn(256, 64, generator=torch.Generator().manual_seed(step))
        return {key: distribute_tensor(full, mesh, [Shard(0)]), "step": torch.tensor(step)}

    for step in (1, 2):
        save_checkpoint(directory, state(step), step)
    save_checkpoint(directory, state(3, "v"), 3)
    if rank == 1:
        FileSystemReader.read_data = _read_one_item_then_fail({"step_00000002"})  # type: ignore[method-assign]
    target = state(0)
    resumed = resume_checkpoint(directory, target)
    equal = torch.equal(target["w"].to_local(), state(1)["w"].to_local()) and int(target["step"]) == 1
    return {"resumed": resumed, "equal": equal, "fresh": resume_checkpoint(directory, state(0, "u"))}


def test_two_ranks_fall_back_together_when_one_rank_cannot_read_a_step(tmp_path: Path) -> None:
    """Step 3 is another model's (DCP fails on both ranks while planning) and rank 1 alone hits a read error on step
    2: both ranks skip both, by name and in the same words (step 2's naming rank 1), and load step 1 bit for bit;
    neither hangs. A model no step fits starts fresh on both ranks, every step named."""
    results = run_ranks(_two_ranks_fall_back, 2, timeout_s=120, args=(str(tmp_path),))
    for r in results:
        assert r["equal"]
        assert (r["resumed"].path, r["resumed"].step) == (tmp_path / "step_00000001", 1)
        assert r["resumed"] == results[0]["resumed"] and r["fresh"] == results[0]["fresh"]
    step_3, step_2 = results[0]["resumed"].skipped
    assert step_3.path.name == "step_00000003" and "Missing key" in step_3.reason, step_3
    assert step_2.path.name == "step_00000002" and "rank 1: OSError: I/O error reading" in step_2.reason, step_2
    assert "rank 0" not in step_2.reason, step_2
    fresh = results[0]["fresh"]
    assert (fresh.path, fresh.step) == (None, None)
    assert [s.path.name for s in fresh.skipped] == ["step_00000003", "step_00000002", "step_00000001"]
    assert all("Missing key" in s.reason for s in fresh.skipped), fresh.skipped


def _two_ranks_one_disk_full(directory: str) -> dict[str, Any]:
    """Step 1 saves; rank 1 alone runs out of space writing step 2 (inside DCP's write, as a full disk does); then
    what each rank raised, and step 3 saved after it."""
    mesh = init_device_mesh("cpu", (2,))

    def state(step: int) -> dict[str, Any]:
        full = torch.randn(256, 64, generator=torch.Generator().manual_seed(step))
        return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": torch.tensor(step)}

    save_checkpoint(directory, state(1), 1)
    real = filesystem._write_item
    if dist.get_rank() == 1:

        def full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        filesystem._write_item = full
    try:
        save_checkpoint(directory, state(2), 2)
        raised = None
    except CheckpointError as e:
        raised = str(e)
    filesystem._write_item = real
    save_checkpoint(directory, state(3), 3)
    return {"raised": raised}


def test_two_ranks_both_raise_a_named_error_when_one_rank_runs_out_of_space(tmp_path: Path) -> None:
    """The run stops cleanly on every rank: both raise CheckpointError with the step, the folder and "no space left"
    (rank 0's own write went well), neither hangs, step 2 is not published, and a later save works."""
    results = run_ranks(_two_ranks_one_disk_full, 2, timeout_s=120, args=(str(tmp_path),))
    for r in results:
        message = r["raised"]
        assert message is not None and f"saving step 2 into {tmp_path} failed" in message, message
        assert "no space left on the device" in message, message
    assert not (tmp_path / "step_00000002").exists()
    assert verify_checkpoint(tmp_path / "step_00000003") == []
