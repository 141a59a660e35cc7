"""The input families (actors/verifier/families.py) as pure functions, and the trusted side's use of
them (reference.py): hand-computed transforms, shapes and dtypes kept, integer inputs untouched,
parameters unpredictable, the plan's order, the retries of a family the reference cannot take, the
float64 allowance and the sensitivity trial's growth. No sandbox: each test runs in milliseconds."""

from __future__ import annotations

import math
import random
import secrets

import pytest
import torch

from actors.verifier import families, reference
from actors.verifier.compare import compare_outputs
from actors.verifier.families import ALL, NORMAL, SENSITIVITY, Drawn
from actors.verifier.reference import Reference, ShapeConfig, Skipped, Trial
from protocols import KernelSpec, Task


def _apply(family: str, x, **params):
    return families.apply(Drawn(family, params), [x])[0]


# ------------------------------------------------------------------------ each family, by hand


def test_offset_adds_a_power_of_two_times_the_spread_per_tensor():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])  # std (unbiased) = sqrt(5/3)
    y = torch.tensor([[0.0, 2.0]])  # std = sqrt(2)
    out = families.apply(Drawn("offset", {"exponents": [7, 8.5], "signs": [-1, 1], "flipped": False}), [x, y])
    assert torch.allclose(out[0], x - 128 * math.sqrt(5 / 3))
    assert torch.allclose(out[1], y + 2**8.5 * math.sqrt(2))


def test_large_and_tiny_multiply_by_an_exact_power_of_two():
    x = torch.tensor([1.5, -3.25, 0.0])
    assert torch.equal(_apply("large", x, exponent=5), torch.tensor([48.0, -104.0, 0.0]))
    assert torch.equal(_apply("tiny", x, exponent=10), x / 1024)


def test_sparse_keeps_elements_or_zeroes_them_and_zeroes_whole_rows():
    x = torch.randn(400, 250) + 10.0  # no zero of its own
    y = _apply("sparse", x, keep=0.2, zero_rows=0.25, seed=7)
    kept = y != 0
    assert torch.equal(y[kept], x[kept])  # an element is x or zero
    rows_zero = (~kept).all(dim=1).float().mean().item()
    assert 0.15 < rows_zero < 0.35  # about a quarter of the rows, zeroed whole
    live = kept[kept.any(dim=1)].float().mean().item()
    assert 0.16 < live < 0.24  # about a fifth of each remaining row
    assert torch.equal(_apply("sparse", x, keep=0.2, zero_rows=0.25, seed=7), y)  # a function of its params
    assert not torch.equal(_apply("sparse", x, keep=0.2, zero_rows=0.25, seed=8), y)


def test_row_scales_multiply_each_row_by_its_own_power_of_two():
    x = torch.randn(64, 9) + 3.0
    y = _apply("row_scales", x, max_exponent=3, seed=1)
    ratio = (y / x).log2()
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio))  # one factor per row
    exponents = ratio[:, 0]
    assert torch.equal(exponents, exponents.round()) and exponents.abs().max() <= 3
    assert len(set(exponents.tolist())) > 3  # varied across rows
    v = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0, 11.0])  # a vector: every element is its own row
    exponents = (_apply("row_scales", v, max_exponent=2, seed=3) / v).log2()
    assert torch.equal(exponents, exponents.round()) and exponents.abs().max() <= 2


def test_near_one_centres_on_one_with_a_width_over_the_root_of_the_row():
    x = torch.tensor([[-1.0, 1.0]])  # mean 0, std (unbiased) sqrt(2), rows of L = 2
    y = _apply("near_one", x, width=0.5)
    assert torch.allclose(y, torch.tensor([[1 - 0.25, 1 + 0.25]]))  # 1 ± 0.5 * 1 / (sqrt(2) * sqrt(2))
    big = _apply("near_one", torch.randn(64, 4096), width=1.0)
    row_log_product = big.double().log().sum(dim=1)  # of order 1: randn's would be about -2600
    assert row_log_product.abs().max() < 8


# ------------------------------------------------------------------ what a family must not change


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ALL)
def test_every_family_keeps_shapes_and_dtypes_and_leaves_integer_inputs_alone(family, dtype):
    x = torch.randn(6, 5).to(dtype)
    index = torch.randint(0, 5, (6,))
    mask = torch.rand(6) > 0.5
    inputs = [x, index, mask, 3, 0.5, torch.randn(2, 3, 4).to(dtype)]
    drawn = families.draw(family, inputs, secrets.SystemRandom())
    out = families.apply(drawn, inputs)
    assert [type(o) for o in out] == [type(i) for i in inputs]
    assert out[1] is index and out[2] is mask and out[3] == 3 and out[4] == 0.5  # untouched, not copies
    for a, b in ((x, out[0]), (inputs[5], out[5])):
        assert b.shape == a.shape and b.dtype == a.dtype and bool(torch.isfinite(b).all()), drawn


def test_a_task_without_floating_inputs_has_nothing_to_transform():
    index = torch.arange(4)
    assert families.draw("offset", [index], random.Random(0)).params == {}
    assert families.apply(Drawn("large", {"exponent": 4}), [index])[0] is index


def test_ranges_follow_the_dtype():
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert families.offset_range(f32) == (7.0, 8.5)  # |mean| of 128 to 362 spreads
    assert families.offset_range(f16) == (6, 6)  # 10 mantissa bits: 4 left for the spread
    assert families.offset_range(bf16) == (3, 3)
    assert families.large_range([f32]) == (4, 31)  # (x·2^k)^4 stays below 2^128
    assert families.large_range([f16]) == (4, 4)  # x16, as before
    assert families.large_range([f32, f16]) == (4, 4)  # one exponent for all: the narrowest dtype's
    assert families.tiny_range([f32]) == (8, 30) and families.tiny_range([f16]) == (3, 3)
    assert families.row_exponent_range([f32]) == (3, 8)


# ----------------------------------------------------------------------- drawing and planning


def test_parameters_are_unpredictable_fresh_draws():
    """Drawn from the operating system's randomness: two verifications share no parameters."""
    rng = secrets.SystemRandom()
    x = [torch.randn(4, 4)]
    for family in ("offset", "sparse", "row_scales", "near_one"):
        draws = {repr(families.draw(family, x, rng).params) for _ in range(8)}
        assert len(draws) > 1, family


def test_the_schedule_holds_every_family_once_in_an_unpredictable_order():
    """After its first trial, the primary shape draws each family and the sensitivity trial once and
    its other plain trials, shuffled; the last plain trial stays last (the canary is built on it)."""
    orders = set()
    for seed in range(20):
        kinds = families.schedule(3, random.Random(seed))
        assert sorted(kinds) == sorted([NORMAL, NORMAL, *ALL, SENSITIVITY]) and kinds[-1] == NORMAL
        orders.add(tuple(kinds))
    assert len(orders) > 10
    assert sorted(families.schedule(1, random.Random(0))) == sorted([*ALL, SENSITIVITY])  # no last plain
    assert families.schedule(2, random.Random(0))[-1] == NORMAL


def test_labels_name_the_shape_for_plain_trials_and_the_family_otherwise():
    kinds = [NORMAL, "offset", NORMAL, SENSITIVITY, "offset"]
    assert families.labels("primary", kinds) == ["primary#0", "offset#0", "primary#1", "sensitivity#0", "offset#1"]


def test_retries_try_the_other_sign_once_and_shrink_a_scale_toward_x16():
    offset = Drawn("offset", {"exponents": [7], "signs": [1], "flipped": False})
    flipped = families.retry(offset)
    assert flipped.params["signs"] == [-1] and flipped.params["flipped"]
    assert families.retry(flipped) is None
    large, seen = Drawn("large", {"exponent": 31}), []
    while large is not None:
        seen.append(large.params["exponent"])
        large = families.retry(large)
    assert seen == [31, 17, 10, 7, 5, 4]
    assert families.retry(Drawn("tiny", {"exponent": 9})) is None


def test_the_sensitivity_mix_and_its_growth():
    base, fresh = [torch.zeros(3), torch.arange(3)], [torch.full((3,), 8.0), torch.arange(3) + 5]
    mixed = families.mix(base, fresh, 0.25)
    assert torch.equal(mixed[0], torch.full((3,), 2.0)) and mixed[1] is base[1]  # indices stay the base's
    assert torch.equal(families.mix(base, fresh, 1.0)[0], fresh[0])
    assert families.next_mix(2**-10, families.MOVE) is None  # moved enough
    assert families.next_mix(2**-10, 5.0) == 2**-10 * 4  # aims at 2 x MOVE: 4x (at least 4x)
    assert families.next_mix(2**-10, 0.5) == 2**-10 * 40
    assert families.next_mix(2**-10, 0.0) == 1.0  # did not move at all: a whole fresh draw
    assert families.next_mix(1.0, 3.0) is None  # a whole fresh draw did not move it: insensitive


# ----------------------------------------------------------------- the trusted side (reference.py)


def _reference(forward: str, draw: str = "torch.randn(16, 256)", alts: str = "[]") -> Reference:
    source = f"""
import torch
import torch.nn as nn

KILN_ALT_SHAPES = {alts}


class Model(nn.Module):
    def forward(self, x):
        return {forward}


def get_inputs():
    return [{draw}]


def get_init_inputs():
    return []
"""
    task = Task(
        task_id="t/spec", kind="kernel", kernel=KernelSpec(name="spec", reference=source, backend="cpu", level=1)
    )
    return Reference(task, "cpu")


def _instance(ref: Reference):
    return ref.instance(ShapeConfig("primary", {}, 3))


class _Negative(random.Random):
    """Draws every offset below zero first."""

    def choice(self, seq):
        return seq[-1] if seq == (1, -1) else super().choice(seq)


def test_an_offset_the_reference_cannot_take_tries_the_other_sign_once(monkeypatch):
    """log of inputs offset below zero is NaN from finite inputs: the other sign is tried (and noted),
    and where neither sign gives finite outputs the family is skipped, not scored.
    Reopened by: families._offset_retry returning None (an offset's NaN skips the family at once)."""
    monkeypatch.setattr(reference, "_FAMILY_RNG", _Negative(0))
    ref = _reference("torch.log(x)", "torch.rand(16, 256) + 0.5")
    trial = ref.trial(_instance(ref), 1, "offset")
    assert isinstance(trial, Trial) and trial.drawn.params["signs"] == [1] and trial.drawn.params["flipped"]
    assert "NaN" in trial.notes[0] and bool((trial.inputs[0] > 0).all())
    both = _reference("torch.cumprod(x, dim=-1)")  # overflows at either sign
    skipped = both.trial(_instance(both), 1, "offset")
    assert isinstance(skipped, Skipped) and "not finite" in skipped.why and len(skipped.notes) == 2


def test_a_large_scale_shrinks_until_the_reference_is_finite_and_a_degenerate_trial_is_retried_once():
    ref = _reference("torch.exp(x)")  # exp overflows past 88: randn x 2^4 stays below
    trial = ref.trial(_instance(ref), 1, "large")
    assert isinstance(trial, Trial) and bool(torch.isfinite(trial.expected[0]).all())
    relu = _reference("torch.relu(x)")
    for _ in range(4):  # an offset below zero makes ReLU's output all zeros: the other sign is taken
        drawn = relu.trial(_instance(relu), 1, "offset")
        assert drawn.degenerate == "" and bool((drawn.expected[0] > 0).all()), drawn.notes


def test_the_offset_trial_allows_the_references_own_float32_error():
    """A reference that computes a variance as E[x^2] - E[x]^2 in float32 is itself off at a large
    offset; an exact kernel (float64) passes there only with the allowance (twice the reference's
    distance from a float64 run of itself), and the one-pass reference's error stays below the limit.
    Reopened by: Family("offset", ..., float64=False) (no allowance: the exact kernel fails)."""
    ref = _reference("(x * x).mean(-1) - x.mean(-1) ** 2", "torch.randn(32, 256)")
    failures_without = 0
    for _ in range(3):
        trial = ref.trial(_instance(ref), 1, "offset")
        assert isinstance(trial, Trial) and trial.allowance and trial.allowance[0] > 0
        exact = [trial.inputs[0].double().var(-1, unbiased=False).float()]
        assert compare_outputs(exact, trial.expected, allowance=trial.allowance).ok
        failures_without += not compare_outputs(exact, trial.expected).ok
    assert failures_without >= 2


def test_a_reference_no_perturbation_moves_is_reported_insensitive():
    ref = _reference("torch.ones_like(x)")
    inst = _instance(ref)
    base = ref.trial(inst, 0)
    assert base.degenerate.startswith("the output is constant")
    skipped = ref.sensitivity_trial(inst, base, 1, None)
    assert isinstance(skipped, Skipped) and skipped.why.startswith("insensitive")


def test_the_sensitivity_trial_moves_the_reference_ten_bounds_from_a_perturbation_of_its_base():
    """Reopened by: MOVE = 0 (any mix counts, and an output that ignores its inputs stays within
    tolerance of both trials)."""
    ref = _reference("torch.softmax(x, dim=-1)")
    inst = _instance(ref)
    base = ref.trial(inst, 0)
    trial = ref.sensitivity_trial(inst, base, 1, None)
    assert isinstance(trial, Trial) and trial.base == 0 and trial.drawn.params["moved"] >= 10  # docs: MOVE
    t = trial.drawn.params["mix"]
    assert 0 < t < 0.1  # a small perturbation: inputs that look like an ordinary draw
    # the base's output, returned again, is outside tolerance on the perturbed inputs
    assert not compare_outputs(base.expected, trial.expected).ok
