"""The no-loss check: a run's episode ids as three independent witnesses saw them.

- The rollout actors: every id replay acknowledged, as each rollout process wrote it down
  (protocols/witness.py, RUN_DIR/witness/acked/).
- Replay: every id it stored and what became of it (its ledger: trained, filtered by reason, pending),
  and the version ranges a learner restore rolled back.
- The learner: every id of every batch it stepped on, with the version the step made
  (RUN_DIR/witness/trained/).

A step whose version a restore rolled back (strictly inside a rolled-back range) is lost learning: its
ids were trained once, then the weights went. So is a step whose learner died after writing its ids and
before announcing the version it made: the batch is stepped on again and makes that version anew, so
an id trained twice for the same version was trained once. The check holds when:
- every acknowledged id was stored (`lost`);
- every id replay counts as trained was trained by a learner step (`trained_unseen`), but for the
  batch last served, whose step a stopped run may not have finished;
- every id a kept learner step trained is counted as trained by replay (`trained_uncounted`);
- no id was trained by two kept steps (`trained_twice`).
An id stored but never acknowledged is not an error (the ack was lost as its sender died; replay
dropped the resend as a duplicate): it is counted (`unacked_stored`). So is what is still pending.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from actors.buffer.health import LedgerIds
from protocols.witness import ACKED, TRAINED, read_lines

SHOWN = 5  # ids named per problem


@dataclass(frozen=True)
class IdCheck:
    acked: int
    stored: int
    trained: int
    filtered: int
    pending: int
    lost_steps: int  # learner steps whose version a restore rolled back
    unacked_stored: int
    problems: dict[str, list[str]] = field(default_factory=dict)  # problem -> the first ids

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"ok": self.ok, **{k: v for k, v in self.__dict__.items() if k != "problems"}, "problems": self.problems}

    def line(self) -> str:
        head = (
            f"{self.acked} acknowledged, {self.stored} stored: {self.trained} trained, {self.filtered} filtered, "
            f"{self.pending} pending"
        )
        if self.ok:
            return f"id check holds: {head}"
        return f"id check FAILS: {head}; " + "; ".join(f"{k}: {', '.join(v)}" for k, v in self.problems.items())


def check_ids(acked: list[str], trained_steps: list[tuple[int, str]], ledger: LedgerIds) -> IdCheck:
    """`acked`: the rollout witnesses' ids; `trained_steps`: (version made, id) per learner step and id."""
    kept = [(v, e) for v, e in trained_steps if not any(lo < v < hi for lo, hi in ledger.rolled_back)]
    # One step's result is announced once: a step that wrote its ids and died before announcing its
    # version was never kept, and its batch is stepped on again to make that same version.
    kept_ids = collections.Counter(e for _, e in set(kept))
    stored, acked_set = ledger.stored, set(acked)
    problems = {
        "lost": sorted(acked_set - stored),
        "trained_unseen": sorted(ledger.trained - ledger.in_step - {e for _, e in trained_steps}),
        "trained_uncounted": sorted(set(kept_ids) - ledger.trained),
        "trained_twice": sorted(e for e, n in kept_ids.items() if n > 1),
    }
    return IdCheck(
        acked=len(acked_set),
        stored=len(stored),
        trained=len(ledger.trained),
        filtered=sum(len(ids) for ids in ledger.filtered.values()),
        pending=len(ledger.pending),
        lost_steps=len({v for v, _ in trained_steps} - {v for v, _ in kept}),
        unacked_stored=len(stored - acked_set),
        problems={k: v[:SHOWN] for k, v in problems.items() if v},
    )


def read_witnesses(run_dir: Path) -> tuple[list[str], list[tuple[int, str]]]:
    """The rollout actors' acknowledged ids and the learner's (version, id) lines, from RUN_DIR/witness/."""
    trained = []
    for line in read_lines(run_dir, TRAINED):
        version, _, episode_id = line.partition(" ")
        if version.isdigit() and episode_id:
            trained.append((int(version), episode_id))
    return read_lines(run_dir, ACKED), trained
