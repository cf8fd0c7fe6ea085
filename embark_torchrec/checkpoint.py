"""Checkpoints you can trust: torch.distributed.checkpoint (DCP) saves with a manifest, verified before resuming.

Layout of a checkpoint directory D: one folder per finished save, ``D/step_<n>`` (n zero-padded to 8 digits), holding
DCP's files (``.metadata`` and the ``__<rank>_<i>.distcp`` data files) and ``manifest.json``: the size and SHA-256 of
every other file in the folder, with the step. Why a manifest: DCP checks neither, so a flipped or truncated data file
loads without a word and training goes on from garbage.

A save never shows half a step: every rank writes into ``D/step_<n>.partial``; once all have finished, rank 0 hashes
the files, writes the manifest last (temporary file, fsync, rename, fsync of the folder) and only then renames the
folder to ``D/step_<n>``. A save cut short leaves a ``.partial`` folder, which resume reports and skips and the next
save of that step replaces.

Resuming (``resume_checkpoint``) loads the newest step that verifies and that DCP loads. The candidates, newest step
first: ``step_<n>`` folders, then ``step_<n>.replaced`` (a second save of step n that stopped between its two renames
leaves its only finished copy there). Each one is verified against its manifest; any problem (a hash mismatch, a
missing file, a manifest of any content: not JSON, nested too deep, a number too long, a wrong type, too large, a
symbolic link) skips it by name. A step that verifies but that DCP cannot load into the given state (another model's
step, a read error on any rank, any exception class DCP raises) is skipped by name too, and the next older one tried.
Rank 0 verifies and broadcasts each choice before any rank loads, and every rank reports how its load went before any
rank moves on, so all ranks load the same step and none is left waiting. Older candidates than the step loaded are
not read; the skipped ones come back newest first with their reasons, then the folders that are never candidates
(unfinished ``.partial`` saves, names that are not ``step_<int>``).

One run at a time: the first save (or claim_checkpoint_directory, which a trainer calls before it plans) makes D
this run's: rank 0 takes an exclusive flock(2) on ``D/owner.lock`` and writes its pid, host, process start and the
time into it, and keeps the lock until its process ends (however it ends: the kernel drops the lock). Another run
that saves into D is refused by name (which process holds D, since when) before it writes anything; a holder whose
process is gone left its lock free, and the next run takes D over (claim_checkpoint_directory returns whom from). Saves
within one process are serialised per directory; before a step is published, rank 0 checks that its lock file is
still the one it holds and that every file its manifest lists is still there at its size, so a step is never
published that verify would reject, whatever runs beside it.

A save that fails (disk full, quota, permission, a read-only file system, an interrupted or failed write on any rank,
any exception class DCP raises: its CheckpointException is a BaseException) raises CheckpointError on every rank,
naming the folder, the step and the cause (a file system's errno, or a nearly full file system, first), and publishes
nothing: the unfinished ``.partial`` folder is left for resume to skip and the next save of that step to replace.
Every rank learns every rank's outcome before raising, so no rank is left waiting in a collective.

Assumptions:
  * Every rank sees the same D: a shared file system, which DCP's FileSystemWriter with its single ``.metadata``
    file already needs. Rank 0 hashes the files all ranks wrote; a save where it cannot see another rank's files
    fails with a message saying so.
  * The file system enforces flock(2) between the hosts that may run rank 0 (local file systems and NFS do; Lustre
    needs its ``flock`` mount option). Where a lock is granted while the recorded holder is a live process on this
    host, the claim is refused, saying that locks are not enforced there.
  * D is trusted. DCP's ``.metadata`` is a pickle, so loading a checkpoint can run code from it; the manifest
    catches damage (a flipped bit, a truncated or deleted file), not someone who can also rewrite the manifest.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import ReadItem

from .plan.model.files import FileTooLarge, open_regular, read_regular

__all__ = [
    "MANIFEST_MAX_BYTES",
    "MANIFEST_NAME",
    "OWNER_NAME",
    "CheckpointError",
    "Holder",
    "Resumed",
    "Skipped",
    "checkpoint_path",
    "claim_checkpoint_directory",
    "latest_verified_checkpoint",
    "load_checkpoint",
    "release_checkpoint_directory",
    "resume_checkpoint",
    "save_checkpoint",
    "step_of",
    "verify_checkpoint",
]

MANIFEST_NAME = "manifest.json"
OWNER_NAME = "owner.lock"  # in D: the flock(2) a run holds while D is its own, and who that run is
HOLDER_WAIT_S = 2.0  # how long a refused claim waits for the holder's record to be written (_awaited_holder)
LOAD_FAILED = "DCP could not load"  # how a skipped step that verified but did not load starts its reason
MANIFEST_MAX_BYTES = 32 << 20  # ~300k files at ~110 bytes an entry; DCP writes one file per rank and writer thread
_FORMAT = "embark-torchrec-checkpoint/1"
_STEP = re.compile(r"step_([0-9]+)")
_PARTIAL, _REPLACED = ".partial", ".replaced"
_LEFTOVER = re.compile(r"step_([0-9]+)(\.partial|\.replaced)")
_LEFTOVER_REASON = {
    _PARTIAL: "unfinished save (written into a temporary folder that never became step_{n})",
    _REPLACED: "an older save of step {n}, left behind while a newer save of that step replaced it",
}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
_SHORT = 200  # characters of a value or an error quoted in a reason: hostile content must not flood the log
_NOT_CAUGHT = (KeyboardInterrupt, SystemExit, GeneratorExit)  # what a failure handler lets through
_OWNER_MAX_BYTES = 1 << 16
_LOW_SPACE = 1 << 20  # free bytes under which a failed save's cause is named as a full file system
_ERRNO_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "input/output error",
    errno.EINTR: "interrupted",
}

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, verified or loaded; the message names the folder or file."""


class Skipped(NamedTuple):
    """A folder that resume_checkpoint passed over, and why."""

    path: Path
    reason: str


class Resumed(NamedTuple):
    """What resume_checkpoint loaded (path and step None when nothing did) and what it skipped, newest first."""

    path: Path | None
    step: int | None
    skipped: list[Skipped]


class Holder(NamedTuple):
    """The run that holds a checkpoint directory: its rank 0's process (pid, host, command line, when the process
    started) and since when it holds the directory (seconds since the epoch)."""

    pid: int
    host: str
    command: str
    started: float | None
    since: float

    @classmethod
    def this_process(cls) -> "Holder":
        return cls(
            os.getpid(), socket.gethostname(), _short(" ".join(sys.argv)), _process_started(os.getpid()), time.time()
        )

    def describe(self) -> str:
        started = f", started {_when(self.started)}" if self.started is not None else ""
        return f"pid {self.pid} on host {self.host} (`{self.command}`{started}), holding it since {_when(self.since)}"

    def running_here(self) -> bool:
        """This process is still running on this host (the same pid started at the same time: not a reused pid)."""
        if self.host != socket.gethostname() or self.pid == os.getpid():
            return False
        started = _process_started(self.pid)
        return started is not None and (self.started is None or abs(started - self.started) < 1.0)


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _process_started(pid: int) -> float | None:
    """When process `pid` of this host started (seconds since the epoch, from /proc), None where not known: no such
    process, or no /proc."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        return round(int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """The folder of `step`'s save under `directory`."""
    return Path(directory) / f"step_{step:08d}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """The step in a folder name step_<int>, None for any other name."""
    match = _STEP.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def _named_step(folder: Path) -> int | None:
    """The step a folder's name claims: step_<n>, or a leftover step_<n>.partial / step_<n>.replaced."""
    match = _STEP.fullmatch(folder.name) or _LEFTOVER.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def _short(value: object) -> str:
    """str(value), cut to a few hundred characters."""
    text = str(value)
    return text if len(text) <= _SHORT else f"{text[:_SHORT]}... ({len(text)} characters)"


def _failure(e: BaseException) -> str:
    """An exception as one line: its class and message; DCP's CheckpointException as what each rank raised."""
    if isinstance(e, CheckpointException):
        return _by_rank({rank: _failure(exc) for rank, (exc, _) in e.failures.items()})
    return f"{type(e).__name__}: {_short(e)}"


def _by_rank(said: dict[int, str], world_size: int | None = None) -> str:
    """What ranks said, each text once with its ranks ("ranks 0-3, 6: ..."); the text alone when all `world_size`
    ranks said it."""
    ranks: dict[str, list[int]] = {}
    for rank in sorted(said):
        ranks.setdefault(said[rank], []).append(rank)
    if len(ranks) == 1 and len(said) == world_size:
        return next(iter(ranks))
    parts = []
    for text, rs in ranks.items():
        runs: list[list[int]] = []
        for r in rs:
            if runs and runs[-1][1] == r - 1:
                runs[-1][1] = r
            else:
                runs.append([r, r])
        spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        parts.append(f"rank{'s' if len(rs) > 1 else ''} {spans}: {text}")
    return "; ".join(parts)


# ---------------------------------------------------------------- files, hashes, the manifest


def _not_a_file(path: Path) -> str | None:
    """Why path is not a regular file a save could have written ("is missing", "is a symbolic link", ...), or None.

    A save writes regular files only: a symbolic link can point outside the folder, and a FIFO or device would block
    or never end when read."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError) as e:  # ValueError: a name with a NUL byte
        return f"cannot be read: {_failure(e)}"
    if stat.S_ISLNK(mode):
        return "is a symbolic link, not a file a save writes"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    return None


def _file_digest(path: Path) -> tuple[int, str]:
    """Size and SHA-256 of a file, read in chunks (data files can be many GB)."""
    digest, size = hashlib.sha256(), 0
    with open_regular(path, follow_links=False) as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _listing(folder: Path) -> list[str]:
    """Every entry under folder except the manifest (and its temporary), as sorted POSIX paths relative to it; links
    to folders count as entries (never walked into)."""
    out = []
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if (Path(root) / d).is_symlink()]:
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


def _write_manifest(folder: Path, step: int) -> dict[str, int]:
    """Hash every file of the save and write manifest.json atomically, so a manifest is either whole or absent;
    returns the size of each file it lists."""
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
    return {rel: entry["size"] for rel, entry in files.items()}


def _count(value: object) -> bool:
    """A JSON integer >= 0 (not a bool, which Python counts as an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad_name(folder: Path, rel: str) -> str | None:
    """Why a manifest's file name cannot be a file of this save (outside the folder, not in the form a save writes)."""
    if "\0" in rel or "\\" in rel or PurePosixPath(rel).as_posix() != rel:
        return "is not a plain relative POSIX path"
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts or "." in parts:
        return f"is outside {folder}"
    if len(parts) > 1 and not Path(os.path.realpath((folder / rel).parent)).is_relative_to(os.path.realpath(folder)):
        return f"is reached through a symbolic link out of {folder}"
    return None


def _read_manifest(folder: Path) -> tuple[int, dict[str, tuple[int, str]]] | str:
    """(step, {file: (size, sha256)}) from folder's manifest, or a problem naming the manifest; never raises on its
    content (any bytes, any JSON: nesting deeper than the parser's stack, integers longer than Python converts)."""
    manifest = folder / MANIFEST_NAME
    not_a_file = _not_a_file(manifest)
    if not_a_file == "is missing":
        return f"no manifest: {manifest} is missing (saved without one, or not by this module)"
    if not_a_file is not None:
        return f"manifest {manifest} {not_a_file}"
    try:
        raw = read_regular(manifest, MANIFEST_MAX_BYTES, follow_links=False)
    except FileTooLarge:
        return f"manifest {manifest} is larger than {MANIFEST_MAX_BYTES} bytes, far more than a save writes"
    except OSError as e:
        return f"manifest {manifest} is unreadable: {_failure(e)}"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        return f"manifest {manifest} is unreadable: {_failure(e)}"
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return f"manifest {manifest} is not in format {_FORMAT!r}"
    step, files = data.get("step"), data.get("files")
    if not _count(step) or not isinstance(files, dict):
        return f"manifest {manifest} lacks an integer 'step' >= 0 or a 'files' table"
    entries: dict[str, tuple[int, str]] = {}
    for rel, entry in files.items():
        bad = _bad_name(folder, rel)
        if bad is not None:
            return f"manifest {manifest} names a file that {bad}: {_short(repr(rel))}"
        if not isinstance(entry, dict) or not _count(entry.get("size")) or not isinstance(entry.get("sha256"), str):
            return f"manifest {manifest}: the entry of {rel!r} lacks an integer 'size' >= 0 or a 'sha256' string"
        if not _SHA256.fullmatch(entry["sha256"]):
            return f"manifest {manifest}: the sha256 of {rel!r} is not 64 lowercase hex digits"
        entries[rel] = (entry["size"], entry["sha256"])
    if ".metadata" not in entries:
        return f"manifest {manifest} does not list DCP's .metadata"
    return step, entries


def _problems(folder: Path) -> list[str]:
    if not folder.is_dir():
        return [f"{folder} is not a folder" if folder.exists() else f"{folder} does not exist"]
    manifest = _read_manifest(folder)
    if isinstance(manifest, str):
        return [manifest]
    step, files = manifest
    problems = []
    named = _named_step(folder)
    if named is not None and named != step:
        problems.append(f"{folder / MANIFEST_NAME} says step {step}, the folder name says step {named}")
    for rel, (size, sha) in sorted(files.items()):
        file = folder / rel
        not_a_file = _not_a_file(file)
        if not_a_file is not None:
            problems.append(f"missing file {file}" if not_a_file == "is missing" else f"file {file} {not_a_file}")
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


def verify_checkpoint(path: str | os.PathLike[str]) -> list[str]:
    """The problems of one step folder against its manifest, each naming the file; empty when every file matches.

    Checks: the manifest is a well-formed regular file, its step matches the folder name, every listed file is a
    regular file inside the folder with the listed size and SHA-256, and no file is there that the manifest does not
    list. Reads every byte of the save. Never raises for what the folder holds: an error reading it is a problem.
    """
    folder = Path(path)
    try:
        return _problems(folder)
    except Exception as e:  # noqa: BLE001 - whatever the folder holds, resume must be able to skip it by name
        return [f"{folder} could not be verified: {_failure(e)}"]


def _candidates(root: Path) -> tuple[list[tuple[int, Path]], list[Skipped]]:
    """The folders resume may load, newest step first (step_<n> before step_<n>.replaced), and those it never may:
    unfinished .partial saves and names that are not step_<int>."""
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {root} cannot be listed: {_failure(e)}") from e
    candidates: list[tuple[int, bool, Path]] = []
    others: list[Skipped] = []
    for entry in entries:
        if not entry.name.startswith("step_"):
            continue
        step, leftover = step_of(entry), _LEFTOVER.fullmatch(entry.name)
        if step is not None:
            candidates.append((step, False, entry))
        elif leftover is not None and leftover.group(2) == _REPLACED:
            candidates.append((int(leftover.group(1)), True, entry))
        elif leftover is not None:
            others.append(Skipped(entry, _LEFTOVER_REASON[_PARTIAL].format(n=leftover.group(1))))
        else:
            others.append(Skipped(entry, "name is not step_<int>"))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2].name))
    return [(step, path) for step, _, path in candidates], others


class _Choice(NamedTuple):
    """Rank 0's next step to load (path None when no candidate is left), the candidates that failed to verify since
    the previous choice, and the folders to report as passed over if this one loads."""

    path: Path | None
    step: int | None
    failed: list[Skipped]
    leftovers: list[Skipped]


def _verified(directory: str | os.PathLike[str]) -> Iterator[_Choice]:
    """The candidates under directory that verify, newest first, then a last choice with path None. Lazy: a
    candidate is read only when the newer ones verified and were passed over (did not load)."""
    root = Path(directory)
    if not root.exists():
        if root.is_symlink():  # a fresh start here would hide the checkpoints the link was meant to reach
            raise CheckpointError(f"checkpoint directory {root} is a symbolic link to nothing: {os.readlink(root)}")
        yield _Choice(None, None, [], [])
        return
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} is not a folder")
    candidates, others = _candidates(root)
    failed: list[Skipped] = []
    for i, (step, folder) in enumerate(candidates):
        problems = verify_checkpoint(folder)
        if problems:
            failed.append(Skipped(folder, "; ".join(problems)))
            continue
        stale = [
            Skipped(p, _LEFTOVER_REASON[_REPLACED].format(n=step))
            for s, p in candidates[i + 1 :]
            if s == step and p.name.endswith(_REPLACED)
        ]
        yield _Choice(folder, step, failed, others + stale)
        failed = []
    yield _Choice(None, None, failed, others)


def latest_verified_checkpoint(directory: str | os.PathLike[str]) -> tuple[Path | None, list[Skipped]]:
    """The newest candidate under directory that verifies (None if none), and what was passed over, newest first.

    Candidates are step_<n> folders and, after them, step_<n>.replaced (see the module's docstring). Folders named
    step_* that are not candidates are reported, never parsed; candidates older than the one chosen are not read. A
    directory that does not exist holds no checkpoint.
    """
    choice = next(_verified(directory))
    return choice.path, choice.failed + choice.leftovers


# ---------------------------------------------------------------- across ranks


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _on_rank0(fn: Callable[[], T], process_group: dist.ProcessGroup | None) -> T:
    """fn's result (or its error, of any class) computed on the group's rank 0 and handed to every rank, so all ranks
    take the same branch and none is left waiting in a collective that another rank abandoned."""
    if not _distributed():
        return fn()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank(process_group) == 0:
        try:
            box[0] = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - every failure must reach the other ranks, not only rank 0
            failure, box[0] = e, ("error", str(e) if isinstance(e, CheckpointError) else _failure(e))
    dist.broadcast_object_list(box, group=process_group, group_src=0)
    status, value = box[0]
    if status == "ok":
        return value
    if failure is not None:
        raise failure
    raise CheckpointError(f"{value} (on rank 0)")


def _every_rank(value: T, process_group: dist.ProcessGroup | None) -> list[T]:
    """value from every rank of the group, in rank order (this rank's alone outside a process group)."""
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, value, group=process_group)
    return out


# ---------------------------------------------------------------- one run at a time

_HELD: dict[str, tuple[int, Holder]] = {}  # directory (real path) -> the locked owner file's fd, and this process
_HELD_LOCK = threading.Lock()
_SAVING: dict[str, threading.Lock] = {}  # directory (real path) -> held while this process saves into it


def _awaited_holder(fd: int) -> Holder | None:
    """The lock holder's record (_read_holder). The holder writes it right after taking the lock, so a claim that lost
    the race by moments waits up to HOLDER_WAIT_S for it, to name the holder rather than say it is not yet written."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    holder = _read_holder(fd)
    while holder is None and time.monotonic() < deadline:
        time.sleep(0.01)
        holder = _read_holder(fd)
    return holder


def _read_holder(fd: int) -> Holder | None:
    """The holder recorded in an owner file, None when it is empty or not a record (being written, or damaged)."""
    try:
        record = json.loads(os.pread(fd, _OWNER_MAX_BYTES, 0).decode("utf-8"))
        return Holder(
            int(record["pid"]), str(record["host"]), str(record["command"]), record["started"], float(record["since"])
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _claim(root: Path) -> Holder | None:
    """Rank 0: make root this process's (see the module's docstring); the holder taken over from, if any."""
    key = os.path.realpath(root)
    owner = root / OWNER_NAME
    with _HELD_LOCK:
        if key in _HELD:
            fd, _ = _HELD[key]
            if _locked_here(owner, fd):
                return None
            os.close(fd)  # the directory or its lock file was removed since: claim it again
            del _HELD[key]
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(owner, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {root} cannot be made this run's: {_cause(e, root)}") from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _awaited_holder(fd)
                who = holder.describe() if holder is not None else "a run whose record in it is not yet written"
                raise CheckpointError(
                    f"checkpoint directory {root} belongs to another run: {who} ({owner}); two runs saving into one "
                    "directory replace each other's steps: wait for it to end, or save into another directory"
                ) from None
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint directory {root} cannot be locked for this run ({owner}): {_failure(e)}; its file "
                    "system must support flock(2) locks"
                ) from e
            previous = _read_holder(fd)
            if previous is not None and previous.running_here():
                raise CheckpointError(
                    f"checkpoint directory {root} belongs to {previous.describe()}, which still runs on this host, "
                    f"though its lock on {owner} is free: this file system does not enforce flock(2) locks"
                )
            me = Holder.this_process()
            record = json.dumps(me._asdict()).encode("utf-8")
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, record, 0)
                os.fsync(fd)
            except OSError as e:
                raise CheckpointError(f"checkpoint directory {root}: writing {owner}: {_cause(e, root)}") from e
        except BaseException:
            os.close(fd)
            raise
        _HELD[key] = (fd, me)
        return previous


def _locked_here(owner: Path, fd: int) -> bool:
    """`owner` is still the file this process locked through `fd` (not removed, nor replaced by another)."""
    try:
        here, locked = os.stat(owner, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (locked.st_dev, locked.st_ino)


def _still_held(root: Path, failing: str) -> None:
    """Rank 0, before publishing: root's owner file is still the one this process locked (not removed or replaced
    by someone else, who may be writing here too)."""
    fd, _ = _HELD[os.path.realpath(root)]
    owner = root / OWNER_NAME
    if not _locked_here(owner, fd):
        raise CheckpointError(
            f"{failing}: {owner}, which this run locked, was removed or replaced while it saved: another run may be "
            f"writing into {root}; {_UNPUBLISHED}"
        )


def claim_checkpoint_directory(
    directory: str | os.PathLike[str], *, process_group: dist.ProcessGroup | None = None
) -> Holder | None:
    """Make `directory` (created if missing) this run's until its rank 0's process ends; call on every rank, before
    the work a refusal would waste (save_checkpoint claims it too). Returns the earlier holder whose process is gone
    that this run took the directory over from (None: nobody held it, or this process already does). Raises
    CheckpointError on every rank, naming the run that holds it and since when, or why it cannot be made (not
    writable, not a folder)."""
    return _on_rank0(lambda: _claim(Path(directory)), process_group)


def release_checkpoint_directory(directory: str | os.PathLike[str]) -> None:
    """Give `directory` up before this process ends (a no-op where it does not hold it), so another run may save
    into it; a process's directories are given up when it ends anyway. Its record is emptied first: a record of a
    live process with a free lock reads as a file system that does not enforce locks."""
    with _HELD_LOCK:
        held = _HELD.pop(os.path.realpath(directory), None)
    if held is not None:
        try:
            os.ftruncate(held[0], 0)
        finally:
            os.close(held[0])  # closing the only descriptor of the open file drops its flock


def _saving(root: Path) -> threading.Lock:
    """The lock this process's saves into root hold: one at a time."""
    with _HELD_LOCK:
        return _SAVING.setdefault(os.path.realpath(root), threading.Lock())


def _exceptions(e: BaseException) -> Iterator[BaseException]:
    """e, what it was raised from or while handling, and each rank's exception in a DCP CheckpointException."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
        if isinstance(x, CheckpointException):
            todo += [exc for exc, _ in x.failures.values()]


def _cause(e: BaseException, folder: Path) -> str:
    """Why a save failed, in one line: what a file system error behind it means (DCP and torch.save wrap them: a
    full disk reads "unexpected pos 704 vs 598"), else a nearly full file system under folder, then e itself."""
    meanings = sorted(
        {_ERRNO_CAUSES[x.errno] for x in _exceptions(e) if isinstance(x, OSError) and x.errno in _ERRNO_CAUSES}
    )
    if not meanings:
        free = _free_bytes(folder)
        if free is not None and free < _LOW_SPACE:
            meanings = [f"the file system of {folder} is full ({free} bytes free)"]
    return "; ".join([*meanings, _failure(e)])


def _free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of folder (or its nearest existing parent)."""
    for path in (folder, *folder.parents):
        try:
            fs = os.statvfs(path)
        except OSError:
            continue
        return fs.f_bavail * fs.f_frsize
    return None


# ---------------------------------------------------------------- save, load, resume


def _clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _begin(root: Path, partial: Path, failing: str) -> None:
    """Rank 0, before any rank writes: root is this run's, and a leftover of an earlier save of this step that
    stopped half-way is gone."""
    try:
        _claim(root)
        _clear(partial)
    except CheckpointError as e:
        raise CheckpointError(f"{failing}: {e}") from e
    except OSError as e:
        raise CheckpointError(
            f"{failing}: removing the unfinished {partial} of an earlier save: {_cause(e, root)}"
        ) from e


def _publish(root: Path, partial: Path, final: Path, step: int, listings: list[list[str]], failing: str) -> None:
    """Rank 0, after every rank wrote: manifest last, then the rename that makes the step visible.

    A second save of a step (a rerun into the same directory) first moves the old one aside as step_<n>.replaced,
    which resume reads when it stops between the two renames; once the new one is visible the old one is removed."""
    mine = set(_listing(partial))
    for rank, theirs in enumerate(listings):
        unseen = sorted(set(theirs) - mine)
        if unseen:
            raise CheckpointError(
                f"{failing}: rank {rank} wrote {', '.join(unseen)} in {partial}, which rank 0 does not see; "
                "the checkpoint directory must be on a file system that every rank shares"
            )
    try:
        files = _write_manifest(partial, step)
    except OSError as e:
        raise CheckpointError(
            f"{failing}: writing the manifest of {partial}: {_cause(e, partial)}; {_UNPUBLISHED}"
        ) from e
    _still_held(root, failing)
    changed = [rel for rel, size in files.items() if _size(partial / rel) != size]
    if changed or _listing(partial) != sorted(files):
        raise CheckpointError(
            f"{failing}: the files in {partial} changed while it was saved ({', '.join(changed) or 'files added'}): "
            f"something else writes there; {_UNPUBLISHED}"
        )
    replaced = final.with_name(final.name + _REPLACED)
    try:
        if final.exists() or final.is_symlink():
            _clear(replaced)
            os.replace(final, replaced)
        os.replace(partial, final)
        _fsync_dir(final.parent)
        _clear(replaced)  # also the only copy a save that stopped between the renames left, now superseded
    except OSError as e:
        raise CheckpointError(
            f"{failing}: renaming {partial} to {final}: {_cause(e, root)} (resume takes the verified copy it left)"
        ) from e


_UNPUBLISHED = "the step was not published (resume skips the unfinished folder; the next save of the step replaces it)"


def _size(path: Path) -> int | None:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return None


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: dict[str, Any],
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save `state` (any DCP state dict: ShardedTensors, DTensors, tensors, picklable objects) as directory/step_<n>.

    Call on every rank of the group, like dcp.save. Returns the step folder, which exists with its manifest on every
    rank's return and was never visible before. Saving a step that exists replaces it. The first save makes the
    directory this run's (claim_checkpoint_directory). Any failure raises CheckpointError on every rank, naming the
    folder, the step and the cause, and publishes nothing (see the module's docstring).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r} (directory {directory})")
    root = Path(directory)
    final = checkpoint_path(root, step)
    partial = final.with_name(final.name + _PARTIAL)
    failing = f"saving step {step} into {root} failed"
    with _saving(root):
        _on_rank0(lambda: _begin(root, partial, failing), process_group)
        error = None
        try:
            dcp.save(state, checkpoint_id=partial, process_group=process_group)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, _NOT_CAUGHT):
                raise
            error = f"DCP failed writing {partial}: {_cause(e, partial)}"
        # also the barrier: every rank has written before rank 0 hashes, and every rank learns every rank's outcome
        outcomes = _every_rank((error, _listing(partial) if error is None else []), process_group)
        failed = {rank: e for rank, (e, _) in enumerate(outcomes) if e is not None}
        if failed:
            raise CheckpointError(f"{failing}: {_by_rank(failed, len(outcomes))}; {_UNPUBLISHED}")
        listings = [listing for _, listing in outcomes]
        _on_rank0(lambda: _publish(root, partial, final, step, listings, failing), process_group)
    return final


class _WatchedLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, noting when DCP first writes into the state: a load that fails before that (another
    model's step fails while planning) left the state as it was."""

    wrote = False

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.wrote = True
        super().load_bytes(read_item, value)

    def resolve_tensor(self, read_item: ReadItem) -> Any:
        self.wrote = True
        return super().resolve_tensor(read_item)


def _load(path: Path, state: dict[str, Any], process_group: dist.ProcessGroup | None) -> tuple[str | None, bool]:
    """Load `path` into `state` in place on every rank: (None when every rank loaded it, else the failure by rank;
    whether any rank's state was written into). Every rank learns every rank's outcome, so all take the same branch."""
    planner = _WatchedLoadPlanner()
    error = None
    try:
        dcp.load(state, checkpoint_id=path, planner=planner, process_group=process_group)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; any failure falls back
        if isinstance(e, _NOT_CAUGHT):
            raise
        error = _failure(e)
    outcomes = _every_rank((error, planner.wrote), process_group)
    failed = {rank: e for rank, (e, _) in enumerate(outcomes) if e is not None}
    wrote = any(w for _, w in outcomes)
    return (_by_rank(failed, len(outcomes)) if failed else None), wrote


def load_checkpoint(
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load the step folder `path` into `state` in place (as dcp.load does), after rank 0 verified it against its
    manifest; raises CheckpointError on every rank, naming the folder, when it does not verify or a rank fails to
    load it."""
    folder = Path(path)
    if verify:
        problems = _on_rank0(lambda: verify_checkpoint(folder), process_group)
        if problems:
            raise CheckpointError(f"checkpoint {folder} does not verify: " + "; ".join(problems))
    error, _ = _load(folder, state, process_group)
    if error is not None:
        raise CheckpointError(f"loading {folder} failed: {error}")


def resume_checkpoint(
    directory: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> Resumed:
    """Load the newest step under `directory` that verifies and loads into `state` (in place); call on every rank.

    Rank 0 verifies and broadcasts each choice, every rank loads it and all learn whether every rank did, so every
    rank ends on the same step. Nothing is loaded when no step verifies and loads (path None; a fresh start); report
    `skipped` to the user either way, it names each folder passed over and why. Raises CheckpointError, naming every
    step tried, when no step loaded but a failed load had already written part of a step into `state`.
    """
    choices = _verified(directory)  # advanced on rank 0 only
    skipped: list[Skipped] = []
    partly_written: Path | None = None
    while True:
        choice = _on_rank0(lambda: next(choices), process_group)
        skipped += choice.failed
        if choice.path is None:
            break
        error, wrote = _load(choice.path, state, process_group)
        if error is None:
            return Resumed(choice.path, choice.step, skipped + choice.leftovers)
        skipped.append(Skipped(choice.path, f"{LOAD_FAILED} {choice.path} into this state: {error}"))
        partly_written = partly_written or (choice.path if wrote else None)
    skipped += choice.leftovers
    if partly_written is not None:
        raise CheckpointError(
            f"no checkpoint in {directory} loads, and the failed load of {partly_written} wrote part of it into the "
            "state, which is therefore not a fresh one: " + "; ".join(f"{s.path}: {s.reason}" for s in skipped)
        )
    return Resumed(None, None, skipped)
