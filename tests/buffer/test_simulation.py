"""The seeded staleness simulation (tests/helpers/simulation.py): a fast producer and a slow learner
around the real ReplayActor. The lag is measured on the TrainBatches the learner receives."""

from __future__ import annotations

import pytest

from tests.helpers.simulation import SimConfig, simulate

STEPS = 20


@pytest.fixture(scope="module")
def results():
    return {eta: simulate(SimConfig(eta=eta, seed=0, steps=STEPS)) for eta in (0, 1, 3)}


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_trained_lag_never_exceeds_eta(results, eta):
    r = results[eta]
    assert r.steps == STEPS and r.trained_samples == STEPS * 4 * 4  # B = 4 groups of G = 4, every step
    assert r.max_lag <= eta
    assert r.invariant_ok
    assert r.admission_waits > 0  # the producer was faster than the learner: admission control worked


def test_eta_zero_is_exactly_synchronous(results):
    r = results[0]
    assert r.lag_histogram == {0: r.trained_samples}
    assert r.filtered.get("stale", 0) > 0  # engines that loaded weights late produced samples that were dropped


def test_larger_eta_buys_throughput_with_bounded_lag(results):
    assert max(results[1].lag_histogram) == 1 and max(results[3].lag_histogram) >= 2  # really asynchronous
    assert results[0].learner_busy < results[1].learner_busy <= results[3].learner_busy


def test_simulation_is_reproducible(results):
    again = simulate(SimConfig(eta=1, seed=0, steps=STEPS))
    assert (again.lag_histogram, again.filtered, again.end_time) == (
        results[1].lag_histogram,
        results[1].filtered,
        results[1].end_time,
    )


def test_groups_that_tie_do_not_hold_back_the_ones_that_train():
    """Three groups in four tie (filtered: no signal) and 24 producers could fill any window. Counted
    whole, the running groups that will tie keep the window full of waste and the learner waits; counted
    as the share that verdicts keep (replay.keep_rate_window), more run at once and the learner trains
    as fast as with no ties, while the batch-time filter still trains nothing staler than η."""
    plain, kept = (
        simulate(SimConfig(eta=1, seed=0, steps=12, workers=24, tie_rate=0.75, keep_rate_window=window))
        for window in (0, 64)
    )
    for r in (plain, kept):
        assert r.steps == 12 and r.max_lag <= 1 and r.invariant_ok
    assert kept.samples_per_time >= 1.3 * plain.samples_per_time
    assert kept.learner_busy > plain.learner_busy
    assert kept.health.admission.keep_rate < 0.5 and plain.health.admission.keep_rate == 1.0
