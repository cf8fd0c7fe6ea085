"""Reading a file a user or another run named: regular files only, never blocking, never unbounded.

Why: a FIFO, a character device or a socket given where a file is expected blocks every rank that opens it (a FIFO
with no writer never returns) or never ends when read (/dev/zero); a file far larger than any real one fills the
memory of every rank that parses it. The one source of this rule for plan, spec and hardware files
(fields.read_document) and for checkpoints (checkpoint.py: manifests and the files they list). Pure Python.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

DOCUMENT_MAX_BYTES = 128 << 20  # a plan file of ~1.5 million cells (~85 bytes a cell); specs and hardware files are kB

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


class NotARegularFile(OSError):
    """The path names something other than a regular file (a FIFO, a device, a folder, a socket or, where links
    are not followed, a symbolic link); str() says which."""


class FileTooLarge(OSError):
    """The file holds more than the reader's limit; `limit` is that limit in bytes."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


def _refuse_special(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise NotARegularFile(f"{kind}, not a regular file")


def open_regular(path: str | os.PathLike[str], follow_links: bool = True) -> BinaryIO:
    """`path` opened for binary reading, or NotARegularFile for anything but a regular file (with `follow_links`
    False, a symbolic link too), checked before opening and again on what was opened (the path may change between
    the two), without blocking: a FIFO is opened non-blocking, so that even one swapped in is refused at once."""
    _refuse_special(os.stat(path).st_mode if follow_links else os.lstat(path).st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0))
    fd = os.open(path, flags)
    try:
        _refuse_special(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike[str], max_bytes: int, follow_links: bool = True) -> bytes:
    """The whole content of the regular file `path` (see open_regular), FileTooLarge past `max_bytes`, read no
    further than one byte past the limit whatever the file's size."""
    with open_regular(path, follow_links) as fh:
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise FileTooLarge(f"larger than {max_bytes} bytes ({_mib(max_bytes)}), the limit for it", max_bytes)
    return raw


def _mib(size: int) -> str:
    return f"{size / (1 << 20):g} MiB"
