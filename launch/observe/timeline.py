"""A run's timeline: the spans of work its actors push (protocols.timeline), kept one JSON line per
span in RUN_DIR/timeline.jsonl, and the arithmetic on them that benchmarks need.

A span says that an actor was doing one activity (generating, verifying, training, syncing) from
`start` to `end`, wall-clock seconds; an actor's time outside all of its spans is waiting. Spans of
one actor and activity may touch or overlap (a recorder pushes a long stretch of work in pieces), so
every measure here works on their union: `covered_s` is the length of that union inside a window,
and `busy_shares` divides it by the window.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from protocols import Span

log = logging.getLogger(__name__)

TIMELINE_FILE = "timeline.jsonl"


@dataclass(frozen=True)
class SpanRow:
    actor: str
    activity: str
    start: float
    end: float
    units: int = 1


class TimelineLog:
    """Append-only RUN_DIR/timeline.jsonl."""

    def __init__(self, run_dir: Path) -> None:
        self._file = open(Path(run_dir) / TIMELINE_FILE, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, spans: Iterable[tuple[str, Span]]) -> None:
        lines = [json.dumps(asdict(SpanRow(actor, s.activity, s.start, s.end, s.units))) for actor, s in spans]
        if lines:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_timeline(run_dir: Path) -> list[SpanRow]:
    """Every span in RUN_DIR/timeline.jsonl; a line that does not parse (a torn write) is skipped."""
    path = Path(run_dir) / TIMELINE_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rows.append(SpanRow(**json.loads(line)))
        except (ValueError, TypeError):
            log.warning("%s: skipping a line that is not a span", path)
    return rows


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals merged where they touch or overlap, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered_s(spans: Iterable[SpanRow], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] inside at least one of `spans`."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in union((s.start, s.end) for s in spans))


def busy_shares(spans: Iterable[SpanRow], t0: float, t1: float) -> dict[str, float]:
    """Per actor, the share of the window [t0, t1] spent in any recorded activity."""
    by_actor: dict[str, list[SpanRow]] = defaultdict(list)
    for s in spans:
        by_actor[s.actor].append(s)
    window = max(t1 - t0, 1e-9)
    return {actor: covered_s(rows, t0, t1) / window for actor, rows in sorted(by_actor.items())}


def activity_shares(spans: Iterable[SpanRow], t0: float, t1: float) -> dict[str, dict[str, float]]:
    """Per actor and activity, the share of the window [t0, t1] spent in it."""
    groups: dict[tuple[str, str], list[SpanRow]] = defaultdict(list)
    for s in spans:
        groups[(s.actor, s.activity)].append(s)
    window = max(t1 - t0, 1e-9)
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (actor, activity), rows in sorted(groups.items()):
        out[actor][activity] = covered_s(rows, t0, t1) / window
    return dict(out)
