"""The driver's monitor (launch/driver/monitor.py): busy shares from the actors' busy counters."""

from __future__ import annotations

import pytest


def test_busy_shares_count_a_restarted_actors_counter_from_zero():
    from types import SimpleNamespace

    from launch.driver.monitor import busy_shares

    counters = {"learner": 10.0, "rollout-0": 50.0}
    handles = [
        SimpleNamespace(name=name, health=lambda timeout_s, name=name: SimpleNamespace(busy_s=counters[name]))
        for name in counters
    ]
    previous: dict[str, float] = {}
    assert busy_shares(handles, previous, 10.0) == {}  # the first reading only sets the baseline
    counters.update({"learner": 12.0, "rollout-0": 6.0})  # rollout-0 was restarted: its counter began again
    assert busy_shares(handles, previous, 10.0) == {
        "busy/learner": pytest.approx(0.2),
        "busy/rollout-0": pytest.approx(0.6),
    }
    counters.update({"learner": 30.0, "rollout-0": 11.0})
    assert busy_shares(handles, previous, 10.0) == {"busy/learner": 1.0, "busy/rollout-0": pytest.approx(0.5)}
