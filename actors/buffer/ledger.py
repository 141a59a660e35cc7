"""The episode ledger: every episode id replay has stored and what became of it.

Invariant over episode ids (docs/replay.md): emitted = trained + filtered (by reason) + pending, where
emitted is every distinct episode id stored. Duplicates and rejected records never enter the ledger
(they are counted apart). The ledger is also the duplicate filter, so it keeps every id of the run.
"""

from __future__ import annotations

import collections

PENDING = "pending"
TRAINED = "trained"
FILTERED = "filtered:"


class EpisodeLedger:
    def __init__(self) -> None:
        self._status: dict[str, str] = {}
        self._counts: collections.Counter[str] = collections.Counter()

    def __contains__(self, episode_id: str) -> bool:
        return episode_id in self._status

    def add_pending(self, episode_id: str) -> None:
        self._set(episode_id, PENDING)

    def mark_trained(self, episode_id: str) -> None:
        self._set(episode_id, TRAINED)

    def mark_filtered(self, episode_id: str, reason: str) -> None:
        self._set(episode_id, FILTERED + reason)

    def _set(self, episode_id: str, status: str) -> None:
        old = self._status.get(episode_id)
        if old is not None:
            self._counts[old] -= 1
        self._status[episode_id] = status
        self._counts[status] += 1

    def summary(self) -> dict:
        filtered = {s.removeprefix(FILTERED): n for s, n in self._counts.items() if s.startswith(FILTERED) and n}
        trained, pending = self._counts[TRAINED], self._counts[PENDING]
        emitted = len(self._status)
        return {
            "emitted": emitted,
            "trained": trained,
            "filtered": filtered,
            "filtered_total": sum(filtered.values()),
            "pending": pending,
            "invariant_ok": emitted == trained + sum(filtered.values()) + pending,
        }

    def ids(self) -> dict[str, list[str]]:
        """Episode ids by status ('pending', 'trained', 'filtered:<reason>'), for audits and tests."""
        out: dict[str, list[str]] = collections.defaultdict(list)
        for episode_id, status in self._status.items():
            out[status].append(episode_id)
        return dict(out)

    def dump(self) -> dict[str, str]:
        return dict(self._status)

    def load(self, status: dict[str, str]) -> None:
        self._status = dict(status)
        self._counts = collections.Counter(self._status.values())
