"""The evaluation's progress line: tasks finished, attempts verified, and the time left, estimated
from this run's own rate (attempts resumed from an earlier run are done but took no time here).
On a terminal the line is redrawn in place; otherwise a line is written every `every_s` seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def eta_seconds(done_here: int, remaining: int, elapsed_s: float) -> float | None:
    """Seconds left at this run's rate; None before the first attempt of this run."""
    if done_here <= 0 or elapsed_s <= 0:
        return None
    return remaining * elapsed_s / done_here


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(
        self,
        tasks: int,
        attempts: int,
        resumed: int,
        *,
        stream: TextIO | None = None,
        every_s: float = 10.0,
        clock=time.monotonic,
    ) -> None:
        self.tasks, self.attempts, self.resumed = tasks, attempts, resumed
        self.stream, self.every_s, self.clock = stream or sys.stderr, every_s, clock
        self.started = self.last = clock()
        self.done_here = 0
        self.tasks_done = 0
        self.tty = self.stream.isatty()

    def line(self) -> str:
        done = self.resumed + self.done_here
        width = 24
        filled = int(width * done / self.attempts) if self.attempts else width
        eta = eta_seconds(self.done_here, self.attempts - done, self.clock() - self.started)
        return (
            f"[{'#' * filled}{'.' * (width - filled)}] tasks {self.tasks_done}/{self.tasks}  "
            f"attempts {done}/{self.attempts}  ETA {_clock(eta)}"
        )

    def update(self, verified: int, tasks_done: int) -> None:
        self.done_here += verified
        self.tasks_done = tasks_done
        now = self.clock()
        if self.tty:
            self.stream.write("\r" + self.line())
            self.stream.flush()
        elif now - self.last >= self.every_s:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self.last = now

    def finish(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self.line() + "\n")
        self.stream.flush()
