"""A learner step's metrics row, completed by the driver with what only it sees: the staleness of the
samples trained since the last row (`staleness/*`), replay's ledger and run totals (`replay/*`: the
episode-id invariant, the retry buffer, filtered groups by reason), and each actor's busy share of
the interval (`busy/<actor>`). The readings are passed in, so the row is a function of them."""

from __future__ import annotations

from collections.abc import Iterable

from actors.buffer.health import ReplayHealth
from launch.driver.monitor import busy_shares
from protocols import metric_keys as mk


class StepRows:
    def __init__(self, now: float) -> None:
        self._lag_seen: dict[int, int] = {}  # replay's trained-lag histogram at the last row
        self._busy: dict[str, float] = {}  # each actor's busy_s at the last row
        self._busy_at = now

    def complete(
        self, values: dict[str, float], replay: ReplayHealth | None, handles: Iterable, now: float
    ) -> dict[str, float]:
        """`values` (the learner's row) with replay's figures (`replay`: None when it did not answer)
        and the busy shares of `handles` since the last row."""
        if replay is not None:
            values.update(self._replay_values(replay))
        busy = busy_shares(handles, self._busy, now - self._busy_at)
        if not values.get(mk.ROLLOUT_GROUPS):  # no group finished in this window: no rollout share to show
            busy = {k: v for k, v in busy.items() if not k.startswith("busy/rollout-")}
        values.update(busy)
        self._busy_at = now
        return values

    def _replay_values(self, health: ReplayHealth) -> dict[str, float]:
        hist = health.trained_lag.histogram
        new = {lag: n - self._lag_seen.get(lag, 0) for lag, n in hist.items() if n > self._lag_seen.get(lag, 0)}
        self._lag_seen = dict(hist)
        out = {mk.staleness_lag(lag): float(n) for lag, n in new.items()}
        if new:
            total = sum(new.values())
            out[mk.STALENESS_MEAN] = sum(lag * n for lag, n in new.items()) / total
            out[mk.STALENESS_MAX] = float(max(new))
        out.update(
            {
                mk.REPLAY_EMITTED: float(health.emitted),
                mk.REPLAY_TRAINED: float(health.trained),
                mk.REPLAY_FILTERED: float(health.filtered_total),
                mk.REPLAY_PENDING: float(health.pending),
                mk.REPLAY_INVARIANT_OK: float(health.invariant_ok),
                mk.REPLAY_RETRY_BUFFER: float(health.retry.size),
                mk.REPLAY_RETRY_ADMITTED: float(health.retry.admitted),
                mk.REPLAY_RETRY_SERVED: float(health.retry.served),
                mk.REPLAY_RETRY_TRAINED: float(health.groups.retry_trained),
                mk.REPLAY_TURN_CREDITED_TURNS: float(health.turn_credited_turns),
            }
        )
        out.update({mk.replay_filtered_groups(reason): float(n) for reason, n in health.groups.filtered.items()})
        return out
