"""What the verifier believes of a jailed reference's replies (actors/verifier/jailed_reference.py): only
descriptors, constants and timings that check out; everything else is the reference's failure. The
process itself, confined and failing, is tested through `kiln serve` (tests/launch/serve/
test_client_references.py)."""

from __future__ import annotations

import pytest

from actors.verifier import timing
from actors.verifier.baselines import times_record
from actors.verifier.jailed_reference import _declared, _described, _trip_times
from actors.verifier.reference_program import ReferenceError


def test_a_tensor_is_read_only_where_its_descriptor_checks_out():
    # Mutation: _described without the size check -> a descriptor that claims 4 bytes for a 4 GB
    # shape (or lies beyond the arena) is read, and the verifier copies memory it never meant to.
    assert _described([64, 16, "float32", [2, 2]], 1 << 16).shape == (2, 2)
    for bad in (
        [64, 4, "float32", [1 << 30]],  # bytes that are not its shape's
        [(1 << 16) - 8, 16, "float32", [4]],  # beyond the arena
        [-64, 16, "float32", [4]],
        [0, 16, "object", [4]],  # a dtype the arena has no name for
        [0, 16, "float32", [2, -2]],
        [0, 16, "float32", [1] * 17 + [4]],  # too many dimensions
        [0, 16.0, "float32", [4]],
        {"v": 1},
        [0, 16, "float32"],
    ):
        assert _described(bad, 1 << 16) is None, bad


def test_a_baseline_is_taken_only_as_timings():
    # Mutation: _figure refuses negative figures everywhere -> a pair whose difference of two trips
    # went below zero (the round trip's noise) makes an honest reference's baseline "malformed".
    honest = timing.TripTimes(4, "cpu", trusted_calls=True, calls=[2e-5, 3e-5], per_call=[-1e-7, 2e-5])
    assert _trip_times(times_record(honest), "cpu") == honest
    for bad in (
        {**times_record(honest), "calls": [float("nan")]},
        {**times_record(honest), "calls": [-1.0]},
        {**times_record(honest), "calls": []},
        {**times_record(honest), "calls_per_trip": 0},
        {**times_record(honest), "device_type": "cuda"},
        {**times_record(honest), "mean_s": 1.0},  # not a field: never passed on
        {**times_record(honest), "run_first": [1]},
        "fast",
    ):
        assert _trip_times(bad, "cpu") is None, bad


def test_declared_constants_are_plain_values():
    declared = _declared(
        {"defaults": {"batch_size": 8, "shape": [2, 3]}, "cpu_shapes": None, "alt_shapes": [], "tolerance": [1e-4, 0]}
    )
    assert declared.defaults == {"batch_size": 8, "shape": (2, 3)}  # hashable: overrides key the caches
    assert declared.alt_shapes == [] and declared.tolerance == (1e-4, 0.0)
    for bad in (
        {"defaults": {1: 2}},
        {"defaults": {"x": {"nested": 1}}},
        {"defaults": {}, "tolerance": [float("inf"), 0]},
        {"defaults": {}, "alt_shapes": {"batch_size": 2}},
        [],
    ):
        with pytest.raises(ReferenceError, match="cannot read"):
            _declared(bad)
