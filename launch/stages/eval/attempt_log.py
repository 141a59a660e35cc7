"""`attempts.jsonl`: one line per verified attempt, written before the attempt counts as done, so an
interrupted evaluation resumes from it without verifying a finished attempt again.

Each line is appended and flushed to disk on its own; a line cut short by a kill (the only torn
line there can be is the last) is cut off when the log is opened again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from actors.rollout.evaluation import EvalAttempt


class AttemptLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[tuple[str, int], EvalAttempt] = {}
        if path.exists():
            self._recover()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the log's life; close() closes it

    def _recover(self) -> None:
        data = self.path.read_bytes()
        good = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
        for line in data[:good].splitlines():
            try:
                attempt = EvalAttempt.from_json(json.loads(line))
            except (ValueError, TypeError, KeyError):
                continue  # an unreadable line is verified again
            self.done[attempt.key] = attempt
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def append(self, attempt: EvalAttempt) -> None:
        self._file.write(json.dumps(attempt.to_json()) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done[attempt.key] = attempt

    def close(self) -> None:
        self._file.close()
