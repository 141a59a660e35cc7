"""Witness logs: what each actor itself says it did with episode ids, kept apart from replay's ledger so
that a run's "nothing lost" claim can be checked against independent accounts (launch/observe/id_check.py).

A rollout actor's process appends each id replay acknowledged (RUN_DIR/witness/acked/NAME-PID.ids);
the learner appends, for each step, the weight version the step produced and each episode id in its
batch (RUN_DIR/witness/trained/NAME-PID.ids). One file per process, so a restarted actor never writes
over its predecessor's account. Lines are appended with one `write` each on an O_APPEND descriptor:
a crash loses at most the line being written, and a torn last line is skipped when read.
"""

from __future__ import annotations

import os
from pathlib import Path

WITNESS_DIR = "witness"
ACKED = "acked"  # rollout actors: ids replay acknowledged holding
TRAINED = "trained"  # the learner: "VERSION ID" per id of each step's batch, VERSION the one the step made


class WitnessLog:
    def __init__(self, run_dir: str | Path, kind: str, name: str) -> None:
        directory = Path(run_dir) / WITNESS_DIR / kind
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}-{os.getpid()}.ids"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, lines: list[str]) -> None:
        """Append `lines` in one write (no newline inside a line)."""
        if lines:
            os.write(self._fd, "".join(f"{line}\n" for line in lines).encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_lines(run_dir: str | Path, kind: str) -> list[str]:
    """Every complete line of every process's log of `kind`, file by file (a torn last line skipped)."""
    lines: list[str] = []
    for path in sorted((Path(run_dir) / WITNESS_DIR / kind).glob("*.ids")):
        text = path.read_text(errors="replace")
        whole = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
        lines.extend(line for line in whole.splitlines() if line)
    return lines
