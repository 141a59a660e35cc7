"""The GPU check's interleaved timing (launch/bench/gpu_megatron_throughput.py), on a fake clock: the
rows it feeds need CUDA and megatron's GPU path, the schedule does not."""

from __future__ import annotations

import statistics

import pytest

from launch.bench.gpu_megatron_throughput import interleaved, spread


class Machine:
    """A clock, and calls that cost their variant's seconds times the machine's slowdown, which grows
    with every call (a GPU warming up, a neighbour's load arriving)."""

    def __init__(self, cost: dict[str, float], drift: float):
        self.now, self.calls, self.cost, self.drift, self.order = 0.0, 0, cost, drift, []

    def call(self, name: str):
        def run():
            self.now += self.cost[name] * (1 + self.drift * self.calls)
            self.calls += 1
            self.order.append(name)

        return run


def test_rounds_alternate_the_order_and_report_seconds_per_call():
    m = Machine({"a": 1.0, "b": 2.0, "c": 3.0}, drift=0.0)
    syncs = []
    times = interleaved(
        {n: m.call(n) for n in "abc"}, rounds=3, per_round=2, sync=lambda: syncs.append(m.now), clock=lambda: m.now
    )
    assert m.order == list("aabbcc" + "ccbbaa" + "aabbcc")
    assert times == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3}
    assert len(syncs) == 2 * 3 * 3  # before and after every variant's calls in every round


def test_a_drifting_machine_charges_equal_variants_alike():
    """Timed one after another, the variant timed last pays the drift; interleaved, equal variants get
    equal medians."""
    m = Machine({"a": 1.0, "b": 1.0}, drift=0.05)
    one_after_another = {n: interleaved({n: m.call(n)}, rounds=4, clock=lambda: m.now)[n] for n in "ab"}
    assert statistics.median(one_after_another["b"]) > 1.15 * statistics.median(one_after_another["a"])
    m = Machine({"a": 1.0, "b": 1.0}, drift=0.05)
    times = interleaved({n: m.call(n) for n in "ab"}, rounds=4, clock=lambda: m.now)
    assert statistics.median(times["a"]) == pytest.approx(statistics.median(times["b"]))


def test_bad_counts_are_refused_and_the_spread_reads_min_to_max():
    with pytest.raises(ValueError, match="rounds and per_round must be >= 1"):
        interleaved({"a": lambda: None}, rounds=0)
    assert spread([0.2, 0.1805, 0.19]) == "[0.180-0.200]"
