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
