"""The output comparison (actors/verifier/compare.py), rule by rule: the absolute tolerance follows
the reference output's scale, NaN never passes, a constant output never matches a reference that
varies, integers match exactly, and honest float error passes."""

from __future__ import annotations

import pytest
import torch

from actors.verifier.compare import compare_outputs, scale_of


def _reference(scale: float = 1.0, n: int = 4096) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(0)) * scale


def test_honest_float_error_passes_at_any_scale():
    for scale in (1e-6, 1.0, 1e6):
        e = _reference(scale)
        got = e * (1 + 1e-5 * torch.randn(e.shape, generator=torch.Generator().manual_seed(1)))
        assert compare_outputs([got], [e]).ok, scale


def test_zeros_do_not_pass_for_an_output_smaller_than_atol():
    """An output whose values are all below atol (1e-3) in absolute terms: zeros are far off in units
    of the output's own scale."""
    e = _reference(1e-5)
    assert float(e.abs().max()) < 1e-3
    result = compare_outputs([torch.zeros_like(e)], [e])
    assert not result.ok and "outside tolerance" in result.message and result.mismatched > len(e) // 2


def test_the_scale_is_the_rms_of_the_finite_reference_values():
    e = torch.tensor([3.0, -4.0, float("inf"), float("nan")])
    assert abs(scale_of(e) - (12.5**0.5)) < 1e-9


def test_nan_never_passes_even_where_the_reference_has_nan():
    e = _reference()
    e[7] = float("nan")
    got = e.clone()
    result = compare_outputs([got], [e])
    assert not result.ok and "NaN never passes" in result.message


def test_infinities_must_match_in_sign_and_place():
    e = _reference()
    e[3] = float("inf")
    assert compare_outputs([e.clone()], [e]).ok
    wrong = e.clone()
    wrong[3] = float("-inf")
    assert not compare_outputs([wrong], [e]).ok


def test_a_constant_output_matches_only_a_reference_within_its_tolerance():
    """The mean of a varying reference, everywhere: fails under the scale-relative bound (no rule
    about constants is needed: a constant that passes is within tolerance of every element)."""
    e = _reference(1e-3)
    result = compare_outputs([torch.full_like(e, float(e.mean()))], [e])
    assert not result.ok and "outside tolerance" in result.message
    flat = torch.full((64,), 2.5)
    assert compare_outputs([flat.clone()], [flat]).ok


def test_a_constant_output_fails_even_within_tolerance_of_a_nearly_flat_reference():
    """1000 + noise of 0.2: its mean is within tolerance (1e-3 x scale 1000 = 1) of every element,
    but it is constant where the reference is not. A reference flat up to rounding is matched."""
    e = 1000.0 + 0.2 * torch.rand(4096, generator=torch.Generator().manual_seed(2))
    mean = torch.full_like(e, float(e.mean()))
    assert float((mean - e).abs().max()) < 1.0
    result = compare_outputs([mean], [e])
    assert not result.ok and "is constant" in result.message
    assert compare_outputs([e * (1 + 1e-6)], [e]).ok  # an honest output of the same reference
    rounded = torch.full((4096,), 1000.0) + torch.randint(0, 2, (4096,)) * 6.1e-5  # one ulp apart
    assert compare_outputs([torch.full_like(rounded, 1000.0)], [rounded]).ok


def test_integers_match_exactly():
    e = torch.arange(100)
    off = e.clone()
    off[50] += 1
    assert compare_outputs([e.clone()], [e]).ok
    result = compare_outputs([off], [e])
    assert not result.ok and "must match exactly" in result.message


def test_shape_dtype_and_count_are_named():
    e = _reference()
    assert "has shape" in compare_outputs([e[:10]], [e]).message
    assert "has dtype" in compare_outputs([e.double()], [e]).message
    assert "returned 2 output(s)" in compare_outputs([e, e], [e]).message


def test_slice_by_slice_gives_the_whole_comparisons_verdicts(monkeypatch):
    """Outputs of gigabytes are compared in slices (compare.CHUNK); the verdict, the count, the place
    and the values quoted are those of the whole tensor, wherever the slice boundaries fall."""
    from actors.verifier import compare

    torch.manual_seed(0)
    e = torch.randn(6, 11)
    off = e.clone()
    off[4, 7] += 1.0
    off[1, 2] += 0.5
    nan = e.clone()
    nan[3, 9], nan[5, 0] = float("nan"), float("nan")
    ints = torch.arange(66).reshape(6, 11)
    wrong_ints = ints.clone()
    wrong_ints[2, 5] = -1
    flat = 1.0 + 1e-4 * e  # within tolerance of a constant, yet not one
    inf = e.clone()
    inf[2, 3] = float("inf")  # some slices all finite (the fast path), one with an infinity
    stray_inf = e.clone()
    stray_inf[5, 10] = float("-inf")
    cases = [
        ([e.clone()], [e]),
        ([off], [e]),
        ([nan], [e]),
        ([torch.ones_like(e)], [flat]),
        ([wrong_ints], [ints]),
        ([inf.clone()], [inf]),
        ([stray_inf], [e]),
    ]
    whole = [compare_outputs(g, x) for g, x in cases]
    monkeypatch.setattr(compare, "CHUNK", {"cuda": 7, "cpu": 7})
    sliced = [compare_outputs(g, x) for g, x in cases]
    assert [(c.ok, c.message, c.mismatched) for c in sliced] == [(c.ok, c.message, c.mismatched) for c in whole]
    assert [c.ok for c in whole] == [True, False, False, False, False, True, False]
    assert "at (4, 7)" in whole[1].message and "first at (3, 9)" in whole[2].message and "constant" in whole[3].message
    assert compare.scale_of(e) == pytest.approx(float(e.double().square().mean().sqrt()))
