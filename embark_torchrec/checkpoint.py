"""Checkpoints you can trust: torch.distributed.checkpoint (DCP) saves with a manifest, verified before resuming.

Layout of a checkpoint directory D: one folder per finished save, ``D/step_<n>`` (n zero-padded to 8 digits), holding
DCP's files (``.metadata`` and the ``__<rank>_<i>.distcp`` data files) and ``manifest.json``: the size and SHA-256 of
every other file in the folder, with the step. Why a manifest: DCP checks neither, so a flipped or truncated data file
loads without a word and training goes on from garbage.

A save never shows half a step: every rank writes into ``D/step_<n>.partial``; once all have finished, rank 0 hashes
the files, writes the manifest last (temporary file, fsync, rename, fsync of the folder) and only then renames the
folder to ``D/step_<n>``. A save cut short leaves a ``.partial`` folder, which resume reports and skips and the next
save of that step replaces.

Resuming (``resume_checkpoint``) takes the newest ``step_<n>`` folder whose files match its manifest. Rank 0 decides and
broadcasts the choice before any rank loads, so all ranks load the same step; the steps it passed over come back
with the reason (hash mismatch, missing file, size differs, no manifest, a name that is not ``step_<int>``).

Assumptions:
  * Every rank sees the same D: a shared file system, which DCP's FileSystemWriter with its single ``.metadata``
    file already needs. Rank 0 hashes the files all ranks wrote; a save where it cannot see another rank's files
    fails with a message saying so.
  * D is trusted. DCP's ``.metadata`` is a pickle, so loading a checkpoint can run code from it; the manifest
    catches damage (a flipped bit, a truncated or deleted file), not someone who can also rewrite the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = [
    "MANIFEST_NAME",
    "CheckpointError",
    "Resumed",
    "Skipped",
    "checkpoint_path",
    "latest_verified_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "save_checkpoint",
    "step_of",
    "verify_checkpoint",
]

MANIFEST_NAME = "manifest.json"
_FORMAT = "embark-torchrec-checkpoint/1"
_STEP = re.compile(r"step_([0-9]+)")
_PARTIAL, _REPLACED = ".partial", ".replaced"
_LEFTOVER = re.compile(r"step_([0-9]+)(\.partial|\.replaced)")
_LEFTOVER_REASON = {
    _PARTIAL: "unfinished save (written into a temporary folder that never became step_{n})",
    _REPLACED: "an older save of step {n}, left behind while a newer save of that step replaced it",
}
_CHUNK = 1 << 20

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, verified or loaded; the message names the folder or file."""


class Skipped(NamedTuple):
    """A folder that resume_checkpoint passed over, and why."""

    path: Path
    reason: str


class Resumed(NamedTuple):
    """What resume_checkpoint loaded (path and step None when nothing verified) and what it skipped, newest first."""

    path: Path | None
    step: int | None
    skipped: list[Skipped]


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """The folder of `step`'s save under `directory`."""
    return Path(directory) / f"step_{step:08d}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step in a folder name step_<int>, None for any other name."""
    match = _STEP.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------- files, hashes, the manifest


def _file_digest(path: Path) -> tuple[int, str]:
    """Size and SHA-256 of a file, read in chunks (data files can be many GB)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _listing(folder: Path) -> list[str]:
    """Every file under folder except the manifest (and its temporary), as sorted POSIX paths relative to it."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = (Path(root) / name).relative_to(folder).as_posix()
            if rel not in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
                out.append(rel)
    return sorted(out)


def _fsync_dir(folder: Path) -> None:
    """Make renames and new entries in folder durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(folder: Path, step: int) -> None:
    """Hash every file of the save and write manifest.json atomically, so a manifest is either whole or absent."""
    files = {}
    for rel in _listing(folder):
        size, sha = _file_digest(folder / rel)
        files[rel] = {"size": size, "sha256": sha}
    tmp = folder / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"format": _FORMAT, "step": step, "files": files}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST_NAME)
    _fsync_dir(folder)


def _read_manifest(folder: Path) -> tuple[int, dict[str, tuple[int, str]]] | str:
    """(step, {file: (size, sha256)}) from folder's manifest, or a problem naming the manifest."""
    manifest = folder / MANIFEST_NAME
    if not manifest.is_file():
        return f"no manifest: {manifest} is missing (saved without one, or not by this module)"
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"manifest {manifest} is unreadable: {e}"
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return f"manifest {manifest} is not in format {_FORMAT!r}"
    step, files = data.get("step"), data.get("files")
    if not isinstance(step, int) or not isinstance(files, dict):
        return f"manifest {manifest} lacks an integer 'step' or a 'files' table"
    entries: dict[str, tuple[int, str]] = {}
    for rel, entry in files.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            return f"manifest {manifest} names a file outside {folder}: {rel!r}"
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            return f"manifest {manifest}: the entry of {rel!r} lacks an integer 'size' or a 'sha256' string"
        entries[rel] = (entry["size"], entry["sha256"])
    if ".metadata" not in entries:
        return f"manifest {manifest} does not list DCP's .metadata"
    return step, entries


def verify_checkpoint(path: str | os.PathLike[str]) -> list[str]:
    """The problems of one step folder against its manifest, each naming the file; empty when every file matches.

    Checks: the manifest is present and well-formed, its step matches the folder name, every listed file exists with
    the listed size and SHA-256, and no file is there that the manifest does not list. Reads every byte of the save.
    """
    folder = Path(path)
    if not folder.is_dir():
        return [f"{folder} is not a folder" if folder.exists() else f"{folder} does not exist"]
    manifest = _read_manifest(folder)
    if isinstance(manifest, str):
        return [manifest]
    step, files = manifest
    problems = []
    named = step_of(folder)
    if named is not None and named != step:
        problems.append(f"{folder / MANIFEST_NAME} says step {step}, the folder name says step {named}")
    for rel, (size, sha) in sorted(files.items()):
        file = folder / rel
        if not file.is_file():
            problems.append(f"missing file {file}")
            continue
        actual_size = file.stat().st_size
        if actual_size != size:
            problems.append(f"size differs: {file} has {actual_size} bytes, the manifest says {size}")
            continue
        _, actual_sha = _file_digest(file)
        if actual_sha != sha:
            problems.append(
                f"hash mismatch on file {file}: SHA-256 {actual_sha[:16]}..., the manifest says {sha[:16]}..."
            )
    for rel in _listing(folder):
        if rel not in files:
            problems.append(f"unexpected file {folder / rel}: not in the manifest")
    return problems


def latest_verified_checkpoint(directory: str | os.PathLike[str]) -> tuple[Path | None, list[Skipped]]:
    """The newest step folder under directory that verifies (None if none), and what was passed over, newest first.

    Folders named step_* that are not step_<int> (leftovers of unfinished saves included) are reported, never parsed;
    step folders older than the one chosen are not read. A directory that does not exist holds no checkpoint.
    """
    root = Path(directory)
    if not root.exists():
        return None, []
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} is not a folder")
    steps: list[tuple[int, Path]] = []
    others: list[Skipped] = []
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith("step_"):
            continue
        step, leftover = step_of(entry), _LEFTOVER.fullmatch(entry.name)
        if step is not None:
            steps.append((step, entry))
        elif leftover is not None:
            others.append(Skipped(entry, _LEFTOVER_REASON[leftover.group(2)].format(n=leftover.group(1))))
        else:
            others.append(Skipped(entry, "name is not step_<int>"))
    skipped: list[Skipped] = []
    for _, folder in sorted(steps, reverse=True):
        problems = verify_checkpoint(folder)
        if not problems:
            return folder, skipped + others
        skipped.append(Skipped(folder, "; ".join(problems)))
    return None, skipped + others


# ---------------------------------------------------------------- across ranks


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _on_rank0(fn: Callable[[], T], process_group: dist.ProcessGroup | None) -> T:
    """fn's result (or its error) computed on the group's rank 0 and handed to every rank, so all ranks take the same
    branch and none is left waiting in a collective that another rank abandoned."""
    if not _distributed():
        return fn()
    box: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank(process_group) == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks, not only rank 0
            failure, box[0] = e, ("error", str(e))
    dist.broadcast_object_list(box, group=process_group, group_src=0)
    status, value = box[0]
    if status == "ok":
        return value
    if failure is not None:
        raise failure
    raise CheckpointError(f"{value} (on rank 0)")


# ---------------------------------------------------------------- save, load, resume


def _clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _prepare(directory: Path, partial: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    _clear(partial)  # a leftover of an earlier save of this step that stopped half-way


def _publish(partial: Path, final: Path, step: int, listings: list[list[str]]) -> None:
    """Rank 0, after every rank wrote: manifest last, then the rename that makes the step visible."""
    mine = set(_listing(partial))
    for rank, theirs in enumerate(listings):
        unseen = sorted(set(theirs) - mine)
        if unseen:
            raise CheckpointError(
                f"saving {final}: rank {rank} wrote {', '.join(unseen)} in {partial}, which rank 0 does not see; "
                "the checkpoint directory must be on a file system that every rank shares"
            )
    _write_manifest(partial, step)
    if final.exists() or final.is_symlink():  # a second save of this step (a rerun into the same directory)
        replaced = final.with_name(final.name + _REPLACED)
        _clear(replaced)
        os.replace(final, replaced)
        os.replace(partial, final)
        _fsync_dir(final.parent)
        _clear(replaced)
    else:
        os.replace(partial, final)
        _fsync_dir(final.parent)


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: dict[str, Any],
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save `state` (any DCP state dict: ShardedTensors, DTensors, tensors, picklable objects) as directory/step_<n>.

    Call on every rank of the group, like dcp.save. Returns the step folder, which exists with its manifest on every
    rank's return and was never visible before. Saving a step that exists replaces it.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r} (directory {directory})")
    final = checkpoint_path(directory, step)
    partial = final.with_name(final.name + _PARTIAL)
    _on_rank0(lambda: _prepare(Path(directory), partial), process_group)
    try:
        dcp.save(state, checkpoint_id=partial, process_group=process_group)
    except Exception as e:
        raise CheckpointError(f"saving {final}: DCP failed writing {partial}: {e}") from e
    listings: list[list[str]] = [_listing(partial)]
    if _distributed():  # also the barrier: every rank has written before rank 0 hashes
        listings = [[] for _ in range(dist.get_world_size(process_group))]
        dist.all_gather_object(listings, _listing(partial), group=process_group)
    _on_rank0(lambda: _publish(partial, final, step, listings), process_group)
    return final


def _load(path: Path, state: dict[str, Any], process_group: dist.ProcessGroup | None) -> None:
    try:
        dcp.load(state, checkpoint_id=path, process_group=process_group)
    except Exception as e:
        raise CheckpointError(f"loading {path} failed: {e}") from e


def load_checkpoint(
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load the step folder `path` into `state` in place (as dcp.load does), after rank 0 verified it against its
    manifest; raises CheckpointError listing the problems, on every rank, when it does not verify."""
    folder = Path(path)
    if verify:
        problems = _on_rank0(lambda: verify_checkpoint(folder), process_group)
        if problems:
            raise CheckpointError(f"checkpoint {folder} does not verify: " + "; ".join(problems))
    _load(folder, state, process_group)


def resume_checkpoint(
    directory: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> Resumed:
    """Load the newest verified step under `directory` into `state` in place; call on every rank.

    Rank 0 scans and verifies, then broadcasts its choice, so every rank loads the same step. Nothing is loaded when
    no step verifies (path None); report `skipped` to the user either way, it says which steps were passed over and why.
    """
    found, skipped = _on_rank0(lambda: latest_verified_checkpoint(directory), process_group)
    if found is None:
        return Resumed(None, None, skipped)
    _load(found, state, process_group)
    return Resumed(found, step_of(found), skipped)
