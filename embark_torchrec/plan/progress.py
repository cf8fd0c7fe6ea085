"""What planning reports as it goes (Progress), and the line that shows it on a terminal (ProgressLine).

The search and pricing call a Progress; only the CLI and EmbarkPlanner draw one, so this sits below them all.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

_BAR_WIDTH = 20

# What planning reports as it goes: (stage, steps done, steps in all or None when open-ended, a note).
Progress = Callable[[str, int, int | None, str], None]


class ProgressLine:
    """Planning progress as one line on a terminal, redrawn in place: nothing for the first `delay_s`
    seconds (a quick plan prints nothing), then at most every `interval_s` within a stage, and at once when
    a new stage begins (else a stage that begins just after a redraw, and runs long without calling again,
    would be shown under the last one's name); close() ends the line. Called as a Progress."""

    def __init__(
        self, label: str = "planning", stream: TextIO | None = None, delay_s: float = 2.0, interval_s: float = 0.2
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._start = time.monotonic()
        self._next = self._start + delay_s
        self._width = 0  # of the line drawn; 0 while none is
        self._delay_end = self._next
        self._stage = ""  # the stage of the line drawn

    def __call__(self, stage: str, done: int, total: int | None = None, note: str = "") -> None:
        now = time.monotonic()
        if now < self._next and (stage == self._stage or now < self._delay_end):
            return
        self._next = now + self.interval_s
        self._stage = stage
        if total:
            filled = _BAR_WIDTH * min(done, total) // total
            stage += f" [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done}/{total}"
        elif done:
            stage += f" {done}"
        self._draw(f"{self.label}: {stage}{', ' + note if note else ''} ({now - self._start:.0f} s)")

    def _draw(self, line: str) -> None:
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        """Ends a line that was drawn with the time planning took; prints nothing if none was."""
        if self._width:
            self._draw(f"{self.label}: done in {time.monotonic() - self._start:.0f} s")
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def progress_line(show: bool | None, label: str = "planning", stream: TextIO | None = None) -> ProgressLine | None:
    """A ProgressLine when `show` (None: when the stream, stderr by default, is a terminal), else None."""
    stream = stream if stream is not None else sys.stderr
    if show is None:
        show = bool(getattr(stream, "isatty", lambda: False)())
    return ProgressLine(label, stream) if show else None
