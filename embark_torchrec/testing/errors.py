"""The error a rank's failure is re-raised as, in both the process and the thread harness."""

from __future__ import annotations

import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """What one rank reports when it fails: plain strings, so it crosses a pipe even if the exception cannot pickle."""

    rank: int
    exc_type: str
    message: str
    traceback_text: str

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankFailure:
        return cls(
            rank=rank,
            exc_type=type(exc).__qualname__,
            message=str(exc),
            traceback_text="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )


class RankError(RuntimeError):
    """A rank raised or died; the message names the rank and carries its traceback, since the frames live elsewhere.

    ``rank``/``exc_type``/``traceback_text`` describe the first failure the harness saw; ``failures`` holds every
    failure that had arrived by the time the others were stopped (peers often fail too, as a consequence).
    """

    def __init__(self, world_size: int, failures: list[RankFailure]) -> None:
        if not failures:
            raise ValueError("RankError needs at least one failure")
        first = failures[0]
        self.rank: int = first.rank
        self.world_size: int = world_size
        self.exc_type: str = first.exc_type
        self.traceback_text: str = first.traceback_text
        self.failures: list[RankFailure] = list(failures)
        parts = [f"rank {first.rank} of {world_size} failed: {first.exc_type}: {first.message}", ""]
        for failure in failures:
            parts.append(f"----- traceback of rank {failure.rank} -----")
            parts.append(failure.traceback_text.rstrip())
        super().__init__("\n".join(parts))
