"""An actor's timeline: what it was doing when, as `Span` records pushed to the driver.

`SpanRecorder` is what an actor holds. `with recorder.span("verifying"):` marks one unit of work
(one generate call, one verification, one learner step). Overlapping units of one activity make
one span, from the first start to the last end, with `units` counting them: eight concurrent
verifications are one stretch of "verifying", so a span says the actor was working, whatever its
concurrency. `record(activity, start, end)` adds a unit that is already over (a follower rank
learns its call's duration afterwards).

Every `flush_s` a thread of the recorder pushes what was recorded since the last push as one
`Timeline` record to the driver's metrics socket: the finished spans, and for each open one the
part so far (the span then goes on from that moment). A long stretch of work therefore reaches the
driver within a second, and a killed actor loses at most its last second. Pushing is best effort:
a slow or absent driver never stalls the actor; what cannot be sent is counted and dropped.

`busy_s()` is the time during which any activity was open: the actor's working time, for the
`busy_s` of its health record. Times are wall-clock seconds (`time.time()`), which processes and
hosts share; only the recorder's thread touches the socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from protocols.channels import PushChannel
from protocols.records import Activity, Span, Timeline

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 0.5


@dataclass
class _Open:
    """An activity with units of work under way."""

    start: float  # since when this span (or the part not pushed yet) runs
    depth: int  # units open now
    units: int  # units that began since `start`


class SpanRecorder:
    def __init__(
        self, actor_id: str, metrics: str | None, *, flush_s: float = 1.0, clock: Callable[[], float] = time.time
    ) -> None:
        """`metrics`: the driver's metrics address; None records only `busy_s` (no driver: tools, tests)."""
        self.actor_id, self.flush_s, self.clock = actor_id, flush_s, clock
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._done: list[Span] = []
        self._depth = 0  # units open over all activities
        self._busy_since = 0.0
        self._busy_total = 0.0
        self.dropped = 0  # spans that could not be pushed
        self._channel = PushChannel(metrics) if metrics else None
        self._stop = threading.Event()
        self._thread = None
        if self._channel is not None:
            self._thread = threading.Thread(target=self._run, name=f"kiln-timeline-{actor_id}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------ recording

    @contextmanager
    def span(self, activity: Activity) -> Iterator[None]:
        self.begin(activity)
        try:
            yield
        finally:
            self.end(activity)

    def begin(self, activity: Activity) -> None:
        with self._lock:
            now = self.clock()
            current = self._open.get(activity)
            if current is None:
                self._open[activity] = _Open(start=now, depth=1, units=1)
            else:
                current.depth += 1
                current.units += 1
            if self._depth == 0:
                self._busy_since = now
            self._depth += 1

    def end(self, activity: Activity) -> None:
        with self._lock:
            now = self.clock()
            current = self._open.get(activity)
            if current is None:  # an end without its begin: a caller's bug, never worth a crash
                log.warning("%s: timeline end of %r without a begin", self.actor_id, activity)
                return
            current.depth -= 1
            if current.depth == 0:
                del self._open[activity]
                if self._channel is not None:
                    self._done.append(
                        Span(activity=activity, start=current.start, end=max(now, current.start), units=current.units)
                    )
            self._depth -= 1
            if self._depth == 0:
                self._busy_total += now - self._busy_since

    def record(self, activity: Activity, start: float, end: float) -> None:
        """A unit of work that is over already. Its time counts as busy in full (callers record such
        units one at a time, never overlapping other work)."""
        with self._lock:
            self._busy_total += max(0.0, end - start)
            if self._channel is not None:
                self._done.append(Span(activity=activity, start=start, end=max(end, start)))

    def busy_s(self) -> float:
        with self._lock:
            open_s = self.clock() - self._busy_since if self._depth else 0.0
            return self._busy_total + open_s

    # -------------------------------------------------------------------------------- pushing

    def take(self) -> list[Span]:
        """What is to be pushed: the finished spans and the part so far of every open one."""
        with self._lock:
            now = self.clock()
            spans, self._done = self._done, []
            for activity, current in self._open.items():
                if now > current.start:
                    spans.append(Span(activity=activity, start=current.start, end=now, units=current.units))
                    current.start, current.units = now, 0
            return spans

    def flush(self) -> None:
        spans = self.take()
        if not spans or self._channel is None:
            return
        try:
            self._channel.send(Timeline(actor_id=self.actor_id, spans=spans), timeout_s=PUSH_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - observability must never stall or kill the actor
            self.dropped += len(spans)
            log.debug("%s: timeline push failed: %s", self.actor_id, err)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()

    def close(self) -> None:
        """Push what is left (open spans up to now) and stop; idempotent."""
        if self._channel is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
        self._channel.close()
        self._channel = None
