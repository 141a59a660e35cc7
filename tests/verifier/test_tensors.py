"""The trusted side's byte-level facts (actors/verifier/tensors.py): bit-for-bit equality slice by
slice, and the replay check's fingerprint, whole for small outputs and sampled for large ones."""

from __future__ import annotations

import torch

from actors.verifier import tensors
from actors.verifier.tensors import FINGERPRINT_WHOLE_BYTES, fingerprint, same_bytes


def test_same_bytes_finds_a_difference_in_any_slice(monkeypatch):
    monkeypatch.setattr(tensors, "SLICE_BYTES", 1 << 10)  # many slices for a 64 KB tensor
    a = torch.randn(128, 128)
    b = a.clone()
    assert same_bytes(a, b)
    b.view(-1)[-1] += 1.0  # in the last slice only
    assert not same_bytes(a, b)
    nan = torch.full((4,), float("nan"))
    assert same_bytes(nan, nan.clone())  # the same NaN bits are the same bytes
    assert not same_bytes(a, a.view(-1))  # another shape


def test_a_repeated_output_has_the_same_fingerprint_and_another_does_not():
    key = 12345
    large = torch.randn(FINGERPRINT_WHOLE_BYTES // 2)  # 2 MB of float32: sampled
    assert fingerprint([large], key) == fingerprint([large.clone()], key)
    assert fingerprint([large], key) != fingerprint([torch.randn_like(large)], key)
    small = torch.randn(1000)  # whole: one changed element changes it
    changed = small.clone()
    changed[500] += 1.0
    assert fingerprint([small], key) != fingerprint([changed], key)
    assert fingerprint([small, large], key) != fingerprint([large, small], key)


def test_a_large_output_is_sampled_at_places_that_depend_on_the_runs_key():
    large = torch.randn(FINGERPRINT_WHOLE_BYTES)  # 4 MB of float32
    # Another run (key) samples other places: the same output fingerprints differently.
    assert fingerprint([large], 7) != fingerprint([large], 8)
    # Within a run, an output changed only away from its sampled places keeps its fingerprint (why
    # only an exact repeat is called a replay, never a near one), and one changed at them does not.
    places = torch.randint(
        large.numel(), (tensors.FINGERPRINT_SAMPLES,), generator=torch.Generator().manual_seed(7 ^ large.numel())
    )
    away = torch.ones(large.numel(), dtype=torch.bool)
    away[places] = False
    elsewhere, there = large.clone(), large.clone()
    elsewhere[away] += 1.0
    there[places[:1]] += 1.0
    assert fingerprint([elsewhere], 7) == fingerprint([large], 7)
    assert fingerprint([there], 7) != fingerprint([large], 7)
