"""The output comparison (actors/verifier/compare.py), rule by rule: the absolute tolerance follows
the reference output's scale, NaN never passes, a constant output never matches a reference that
varies, integers match exactly, and honest float error passes; the float64 allowance at large offsets,
how far an output moved (the sensitivity trial) and when a reference output is degenerate."""

from __future__ import annotations

import pytest
import torch

from actors.verifier.compare import allowances, compare_outputs, degeneracy, move_ratio, scale_of, surely_passes


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


def test_the_allowance_widens_every_elements_bound_by_twice_the_references_own_error():
    """By hand: the reference's float32 output is 0.02 off a float64 run of itself at one element,
    so the bound grows by 0.04 everywhere; an output 0.03 off passes only with it.
    Reopened by: compare_outputs ignoring `allowance`."""
    exact = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    e = exact.float().clone()
    e[2] += 0.02
    (allow,) = allowances([e], [exact])
    assert allow == pytest.approx(0.04, rel=1e-5)
    got = e.clone()
    got[1] += 0.03  # bound there: 1e-3 x scale 2.74 + 1e-3 x 2 = 0.0047
    assert not compare_outputs([got], [e]).ok
    result = compare_outputs([got], [e], allowance=[allow])
    assert result.ok
    worse = e.clone()
    worse[1] += 0.05
    result = compare_outputs([worse], [e], allowance=[allow])
    assert not result.ok and "for the reference's own float32 error" in result.message
    assert allowances([torch.arange(3)], [torch.arange(3)]) == [0.0]  # integers: exact


def test_move_ratio_counts_tolerance_bounds_of_the_later_output():
    before = torch.tensor([1.0, -1.0, 1.0, -1.0])
    after = before.clone()
    after[0] = 1.1  # moved 0.1; bound there: 1e-3 x after's scale sqrt(4.21 / 4) + 1e-3 x 1.1
    assert move_ratio([before], [after]) == pytest.approx(0.1 / (1e-3 * (4.21 / 4) ** 0.5 + 1.1e-3), rel=1e-5)
    assert move_ratio([before], [before.clone()]) == 0.0
    assert move_ratio([torch.arange(4)], [torch.arange(4) + (torch.arange(4) == 2)]) == float("inf")
    assert move_ratio([torch.zeros(3)], [torch.tensor([0.0, 1e-30, 0.0])]) > 10  # from nothing: any move counts


def test_degeneracy_names_a_constant_or_mostly_zero_reference():
    """Reopened by: DEGENERATE_ZERO_SHARE = 1.0 (a cumprod whose products underflowed is not named)."""
    assert degeneracy([torch.randn(1000)]) == ""
    assert "constant" in degeneracy([torch.full((100,), 3.0)])
    assert degeneracy([torch.randn(2, 3), torch.full((4,), 1.0)]).startswith("output 1 is constant")
    products = torch.cumprod(torch.randn(8, 4000), dim=-1)  # randn's products underflow after ~100
    assert "within tolerance of 0" in degeneracy([products])
    sparse = torch.zeros(1000)
    sparse[:100] = torch.randn(100)  # 90% zeros: a zero output fails on the rest
    assert degeneracy([sparse]) == ""
    assert degeneracy([torch.arange(10)]) == ""  # exact outputs are never degenerate


def _fast_cases() -> dict[str, tuple[list, list]]:
    """Outputs on both sides of every rule of compare_outputs, and at its edges."""
    e = _reference(3.0)
    bound = 1e-3 * float(e.square().mean().sqrt()) + 1e-3 * e.abs()
    flat = torch.full((4096,), 0.5)
    near_flat = flat + torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 1e-7
    ints = torch.arange(100, dtype=torch.int64)
    return {
        "exact": ([e.clone()], [e]),
        "honest error": ([e + bound * 0.5], [e]),
        "just inside the bound": ([e + bound * 0.9995], [e]),
        "just outside the bound": ([e + bound * 1.001], [e]),
        "one element off": ([torch.cat([e[:-1], e[-1:] + 1.0])], [e]),
        "a NaN": ([torch.cat([e[:-1], torch.tensor([float("nan")])])], [e]),
        "an infinity": ([torch.cat([e[:-1], torch.tensor([float("inf")])])], [e]),
        "constant against a varying reference": ([torch.full_like(e, float(e.mean()))], [e]),
        "constant against a constant reference": ([flat.clone()], [flat]),
        "constant within the bound of a varying reference": ([flat.clone()], [flat + (torch.arange(4096) % 2) * 2e-4]),
        "constant against a reference flat up to rounding": ([flat.clone()], [near_flat]),
        "half": ([e.half() + 0.001], [e.half()]),
        "integers equal": ([ints.clone()], [ints]),
        "integers differ": ([ints + (ints == 7)], [ints]),
        "a shape differs": ([e[:-1]], [e]),
        "a dtype differs": ([e.double()], [e]),
        "two outputs, the second wrong": ([e.clone(), e + 1.0], [e, e]),
    }


@pytest.mark.parametrize("case", list(_fast_cases()))
def test_the_fast_check_of_timed_calls_never_passes_what_the_full_comparison_fails(case):
    """The timed calls' batched check (performance._cleared) accepts an output only through
    surely_passes; anything it does not clear goes to compare_outputs. So it must never clear an
    output compare_outputs fails: mutation `FAST_MARGIN = 1.01` makes "just outside the bound" pass
    here, and dropping the `varies` term makes the constant output pass."""
    got, expected = _fast_cases()[case]
    flag = surely_passes(got, expected)
    full = compare_outputs(got, expected)
    if flag is not None and bool(flag):
        assert full.ok, f"{case}: cleared by the fast check, failed by compare_outputs: {full.message}"
    expect_cleared = case in {
        "exact",
        "honest error",
        "integers equal",
        "half",
        "constant against a constant reference",
    }
    assert (flag is not None and bool(flag)) == expect_cleared, case
