"""The learner's loss functions against numbers computed by hand (actors/learner/losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.learner.losses import (
    ENTROPY_ROWS,
    ClipStats,
    filter_stats,
    kl_penalty,
    mirrorpop_mask,
    policy_loss,
    policy_loss_on_device,
    sft_loss,
    token_entropy,
    token_logprobs_from_logits,
)


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# ------------------------------------------------------------------------------------ MirrorPop

# Four sequences, δ = 0.25 (all values exact in binary floating point):
#  seq 0: drifts +0.5 then -0.5: signed mean 0, mean |·| = 0.5 > δ -> dropped
#  seq 1: drifts 0.125, -0.25 on gradient tokens (and 4.0 on a masked one): mean |·| = 0.1875 -> kept
#  seq 2: no gradient-carrying token -> not kept, deviation 0
#  seq 3: drift exactly δ -> kept (the rule is D <= δ)
PROX = [-1.0, -2.0, -1.0, -1.0, -1.0, -3.0, -0.25]
BEHAVIOUR = [-1.5, -1.5, -1.125, -0.75, -5.0, -1.0, -0.5]
MASK = [1, 1, 1, 1, 0, 0, 1]
SEQ = [0, 0, 1, 1, 1, 2, 3]


def test_mirrorpop_uses_absolute_deviation_and_keeps_on_equality():
    keep, kept, deviation = mirrorpop_mask(
        t(PROX), t(BEHAVIOUR), t(MASK, torch.bool), t(SEQ, torch.int64), num_seqs=4, delta=0.25, token_delta=None
    )
    assert keep.tolist() == [False, True, False, True]
    assert kept.tolist() == [False, False, True, True, False, False, True]
    assert deviation.tolist() == [0.5, 0.1875, 0.0, 0.25]


def test_mirrorpop_keeps_everything_on_policy_and_drops_all_past_a_small_delta():
    seq = t(SEQ, torch.int64)
    keep, _, deviation = mirrorpop_mask(
        t(PROX), t(PROX), t(MASK, torch.bool), seq, num_seqs=4, delta=1e-6, token_delta=1e-6
    )
    assert keep.tolist() == [True, True, False, True] and deviation.abs().max() == 0
    keep, _, _ = mirrorpop_mask(
        t(PROX), t(BEHAVIOUR), t(MASK, torch.bool), seq, num_seqs=4, delta=0.1, token_delta=None
    )
    assert not keep.any()


def test_filter_stats_count_before_and_after_filtering():
    mask, seq = t(MASK, torch.bool), t(SEQ, torch.int64)
    keep, kept, deviation = mirrorpop_mask(t(PROX), t(BEHAVIOUR), mask, seq, num_seqs=4, delta=0.25, token_delta=None)
    stats = filter_stats(t(PROX), t(BEHAVIOUR), mask, keep, kept, deviation, seq, is_cap=1.25)
    # sequences with gradient tokens: 0, 1, 3; kept: 1, 3; |log ρ| over the 5 gradient tokens
    assert (stats.sequences, stats.kept_sequences, stats.tokens, stats.kept_tokens) == (3, 2, 5, 3)
    assert stats.abs_log_rho_sum == pytest.approx(0.5 + 0.5 + 0.125 + 0.25 + 0.25)
    m = stats.metrics()
    assert m["kept_fraction"] == pytest.approx(2 / 3) and m["kept_token_fraction"] == pytest.approx(3 / 5)
    assert m["abs_log_rho_mean"] == pytest.approx(1.625 / 5)
    assert m["deviation_mean"] == pytest.approx((0.5 + 0.1875 + 0.25) / 3)  # seq 2 has no gradient token
    # kept tokens' log ρ: 0.125, -0.25, 0.25; w = min(e^log ρ, 1.25): e^0.25 = 1.284 is truncated
    assert m["kept_abs_log_rho_mean"] == pytest.approx(0.625 / 3)
    assert m["is_weight_mean"] == pytest.approx((math.exp(0.125) + math.exp(-0.25) + 1.25) / 3)
    assert (m["is_weight_max"], m["is_weight_min"]) == pytest.approx((1.25, math.exp(-0.25)))
    assert m["is_truncated_fraction"] == pytest.approx(1 / 3) and m["is_truncated"] == 1
    # MirrorPop dropped sequence 0 (its deviation 0.5 > δ); sequence 2 has no gradient token to drop
    assert stats.dropped == (0,) and m["mirrorpop_dropped"] == 1
    assert stats.token_masked == 0 and m["mirrorpop_token_masked"] == 0  # no token bound
    assert m["deviation_max"] == pytest.approx(0.5)


# ------------------------------------------------------------------ MirrorPop without dilution

# The sequence: 4,000 gradient-carrying tokens, 20 of them 10 nats off (ten at +10, ten at
# -10), the rest on policy. D = 20·10/4000 = 0.05 <= δ = 0.3, so the sequence filter keeps it
# whole; the token bound δ_tok = 2 takes exactly the 20 far-off tokens out of the gradient.
LONG = 4000
FAR = list(range(100, LONG, 200))  # 20 positions
LONG_DRIFT = [0.0] * LONG
for i, position in enumerate(FAR):
    LONG_DRIFT[position] = 10.0 if i % 2 == 0 else -10.0


def long_sequence():
    """(prox, behaviour, mask, seq_index) of the issue's sequence: log π_prox = -1, log μ = -1 - drift."""
    prox = torch.full((LONG,), -1.0)
    return prox, prox - t(LONG_DRIFT), torch.ones(LONG, dtype=torch.bool), torch.zeros(LONG, dtype=torch.int64)


def test_the_sequence_mean_keeps_a_long_sequence_with_far_off_tokens_and_the_token_bound_masks_them():
    prox, behaviour, mask, seq = long_sequence()
    keep, kept, deviation = mirrorpop_mask(prox, behaviour, mask, seq, num_seqs=1, delta=0.3, token_delta=None)
    assert deviation.tolist() == pytest.approx([0.05]) and keep.tolist() == [True] and bool(kept.all())

    keep, kept, deviation = mirrorpop_mask(prox, behaviour, mask, seq, num_seqs=1, delta=0.3, token_delta=2.0)
    assert deviation.tolist() == pytest.approx([0.05])  # D counts every gradient-carrying token either way
    assert keep.tolist() == [True] and torch.nonzero(~kept).flatten().tolist() == FAR
    stats = filter_stats(prox, behaviour, mask, keep, kept, deviation, seq, is_cap=5.0)
    assert (stats.tokens, stats.kept_tokens, stats.token_masked, stats.dropped) == (4000, 3980, 20, ())
    m = stats.metrics()
    assert m["mirrorpop_token_masked"] == 20 and m["mirrorpop_dropped"] == 0
    assert m["kept_token_fraction"] == pytest.approx(3980 / 4000) and m["kept_fraction"] == 1.0
    # the kept tokens are on policy: w = 1, |log ρ| = 0
    assert (m["is_weight_mean"], m["kept_abs_log_rho_mean"], m["is_truncated"]) == (1.0, 0.0, 0.0)


def test_the_token_bound_keeps_its_equality_and_drops_a_sequence_it_empties():
    # seq 0: drifts 0.5 and 1.0; δ_tok = 0.5 keeps the first (the rule is <=) and masks the second
    # seq 1: drifts 1.0 on its only gradient token: nothing left to train on, so it is dropped
    prox, behaviour = t([-1.0, -1.0, -1.0]), t([-1.5, -2.0, -2.0])
    mask, seq = t([1, 1, 1], torch.bool), t([0, 0, 1], torch.int64)
    keep, kept, deviation = mirrorpop_mask(prox, behaviour, mask, seq, num_seqs=2, delta=None, token_delta=0.5)
    assert keep.tolist() == [True, False] and kept.tolist() == [True, False, False]
    assert deviation.tolist() == [0.75, 1.0]
    stats = filter_stats(prox, behaviour, mask, keep, kept, deviation, seq, is_cap=5.0)
    assert (stats.kept_tokens, stats.token_masked, stats.dropped) == (1, 1, (1,))


def test_with_both_switches_off_mirrorpop_drops_nothing():
    # PROX/BEHAVIOUR above, where δ = 0.25 drops seq 0: every sequence with a gradient token now trains
    mask, seq = t(MASK, torch.bool), t(SEQ, torch.int64)
    keep, kept, deviation = mirrorpop_mask(t(PROX), t(BEHAVIOUR), mask, seq, num_seqs=4, delta=None, token_delta=None)
    assert keep.tolist() == [True, True, False, True] and torch.equal(kept, mask)
    assert deviation.tolist() == [0.5, 0.1875, 0.0, 0.25]  # still measured
    stats = filter_stats(t(PROX), t(BEHAVIOUR), mask, keep, kept, deviation, seq, is_cap=1.25)
    assert (stats.kept_tokens, stats.token_masked, stats.dropped) == (5, 0, ())
    m = stats.metrics()
    assert (m["mirrorpop_dropped"], m["mirrorpop_token_masked"], m["kept_token_fraction"]) == (0.0, 0.0, 1.0)


def test_tokens_the_bound_masks_carry_no_gradient():
    prox, behaviour, mask, seq = long_sequence()
    logprobs = prox.clone().requires_grad_(True)  # r = 1: the first update
    adv = torch.ones(LONG)
    kw = {"eps_low": 0.2, "eps_high": 0.28, "is_cap": 5.0}
    # unbounded: every token trains; d/dlogπ of -w·r·A/4000 is -w/4000, with w = min(e^10, 5) = 5 on
    # the +10 tokens and e^-10 on the -10 tokens
    _, kept, _ = mirrorpop_mask(prox, behaviour, mask, seq, num_seqs=1, delta=0.3, token_delta=None)
    loss, _ = policy_loss(logprobs, prox, behaviour, adv, kept, normalizer=4000.0, **kw)
    loss.backward()
    assert logprobs.grad[FAR[0]] == pytest.approx(-5 / 4000) and logprobs.grad[FAR[1]] == pytest.approx(
        -math.exp(-10) / 4000
    )
    # bounded at δ_tok = 2: the 20 far-off tokens carry none, each other token -1/3980
    logprobs.grad = None
    _, kept, _ = mirrorpop_mask(prox, behaviour, mask, seq, num_seqs=1, delta=0.3, token_delta=2.0)
    loss, stats = policy_loss(logprobs, prox, behaviour, adv, kept, normalizer=3980.0, **kw)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.0) and stats.tokens == 3980
    assert logprobs.grad[FAR].abs().max() == 0
    assert logprobs.grad[kept].tolist() == pytest.approx([-1 / 3980] * 3980)


# ---------------------------------------------------------------------------------- policy loss

EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 2.0
# token: (log r, log ρ = log π_prox - log μ, advantage, mask) and its hand-computed term -w·min(rA, clip(r)A)
#  a: r = 1.5, ρ = 0.5, A = +1: min(1.5, 1.28) = 1.28 (clipped high), w = 0.5  -> -0.64
#  b: r = 0.5, ρ = 3,   A = -1: min(-0.5, -0.8) = -0.8 (clipped low), w = min(3, 2) = 2 (truncated) -> +1.6
#  c: r = 1.5, ρ = 1,   A = -1: min(-1.5, -1.28) = -1.5 (unclipped: a negative advantage is not clipped
#     above), w = 1 -> +1.5
#  d: r = 0.5, ρ = 1,   A = +1: min(0.5, 0.8) = 0.5 (unclipped), w = 1 -> -0.5
#  e: masked out; its huge values must not matter
LOG_R = [math.log(1.5), math.log(0.5), math.log(1.5), math.log(0.5), 30.0]
LOG_RHO = [math.log(0.5), math.log(3.0), 0.0, 0.0, -30.0]
ADV = [1.0, -1.0, -1.0, 1.0, 100.0]
PMASK = [1, 1, 1, 1, 0]
NORMALIZER = 8.0
EXPECTED_LOSS = (-0.64 + 1.6 + 1.5 - 0.5) / NORMALIZER


def policy_inputs():
    prox = t([-1.0, -2.0, -0.5, -3.0, -1.0])
    logprobs = (prox + t(LOG_R)).requires_grad_(True)
    behaviour = prox - t(LOG_RHO)
    return logprobs, prox, behaviour, t(ADV), t(PMASK, torch.bool)


def test_policy_loss_matches_hand_computation():
    logprobs, prox, behaviour, adv, mask = policy_inputs()
    loss, stats = policy_loss(
        logprobs, prox, behaviour, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, is_cap=CAP, normalizer=NORMALIZER
    )
    assert float(loss.detach()) == pytest.approx(EXPECTED_LOSS, abs=1e-6)
    loss.backward()
    # Clipped tokens (a, b) get no gradient; c: d/dlogπ of -w·r·A = -1·1.5·(-1) = 1.5; d: -1·0.5·1 = -0.5.
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 1.5 / NORMALIZER, -0.5 / NORMALIZER, 0.0], abs=1e-7)
    assert stats == ClipStats(tokens=4, clipped_low=1, clipped_high=1)  # b below, a above
    assert stats.metrics() == {
        "clip_fraction": 0.5,
        "clip_low_fraction": 0.25,
        "clip_high_fraction": 0.25,
        "clipped": 2.0,
    }


def test_the_clip_counts_stay_on_the_device_until_read():
    logprobs, prox, behaviour, adv, mask = policy_inputs()
    kw = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "is_cap": CAP, "normalizer": NORMALIZER}
    loss, counts = policy_loss_on_device(logprobs, prox, behaviour, adv, mask, **kw)
    assert isinstance(counts, torch.Tensor) and counts.dtype == torch.int64 and counts.device == loss.device
    assert ClipStats.of(counts) == policy_loss(logprobs, prox, behaviour, adv, mask, **kw)[1]
    assert ClipStats.of(counts) == ClipStats(tokens=4, clipped_low=1, clipped_high=1)


def test_is_weight_carries_no_gradient_into_the_proximal_logprobs():
    logprobs, prox, behaviour, adv, mask = policy_inputs()
    prox.requires_grad_(True)
    loss, _ = policy_loss(
        logprobs, prox, behaviour, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, is_cap=CAP, normalizer=NORMALIZER
    )
    loss.backward()
    assert prox.grad is None


def test_micro_batch_losses_and_stats_add_up_to_the_whole():
    logprobs, prox, behaviour, adv, mask = policy_inputs()
    kw = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "is_cap": CAP, "normalizer": NORMALIZER}
    whole, whole_stats = policy_loss(logprobs, prox, behaviour, adv, mask, **kw)
    parts = [policy_loss(logprobs[s], prox[s], behaviour[s], adv[s], mask[s], **kw) for s in (slice(0, 2), slice(2, 5))]
    assert float((parts[0][0] + parts[1][0]).detach()) == pytest.approx(float(whole.detach()), abs=1e-7)
    assert parts[0][1] + parts[1][1] == whole_stats


def test_empty_stats_report_zeros():
    assert set(ClipStats().metrics().values()) == {0.0}
    _, stats = policy_loss(
        t([0.0]),
        t([0.0]),
        t([0.0]),
        t([1.0]),
        t([0], torch.bool),
        eps_low=0.2,
        eps_high=0.2,
        is_cap=2.0,
        normalizer=1.0,
    )
    assert stats == ClipStats()
    mask, seq = t([0, 0], torch.bool), t([0, 0], torch.int64)
    keep, kept, deviation = mirrorpop_mask(
        t([0.0, 0.0]), t([0.0, 0.0]), mask, seq, num_seqs=1, delta=0.1, token_delta=0.1
    )
    empty = filter_stats(t([0.0, 0.0]), t([0.0, 0.0]), mask, keep, kept, deviation, seq, is_cap=2.0)
    assert set(empty.metrics().values()) == {0.0}


# ------------------------------------------------------------------------------ SFT, KL, logits


def test_sft_loss_is_masked_cross_entropy():
    logprobs = t([-1.0, -2.0, -4.0])
    assert float(sft_loss(logprobs, t([1, 0, 1], torch.bool), normalizer=2.0)) == pytest.approx(2.5)


def test_kl_penalty_is_k3():
    # x = log π_ref - log π_θ = log 0.25 - log 0.5 = -ln 2: e^x - x - 1 = 0.5 + ln 2 - 1
    logprobs, ref = t([math.log(0.5), math.log(0.5), 0.0]), t([math.log(0.25), math.log(0.5), -9.0])
    value = kl_penalty(logprobs, ref, t([1, 1, 0], torch.bool), normalizer=2.0)
    assert float(value) == pytest.approx((math.log(2) - 0.5) / 2, abs=1e-7)
    assert float(kl_penalty(ref, ref, t([1, 1, 1], torch.bool), normalizer=1.0)) == 0.0


def test_token_entropy_applies_temperature():
    # row 1: logits / 0.5 = [0, ln 3] -> softmax (1/4, 3/4); row 2: uniform over two -> ln 2
    logits = t([[0.0, 0.5 * math.log(3.0)], [1.0, 1.0]])
    expected = [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0)]
    assert token_entropy(logits, 0.5).tolist() == pytest.approx(expected, abs=1e-6)


def test_token_entropy_in_chunks_equals_the_whole():
    logits = torch.randn(2 * ENTROPY_ROWS + 5, 7, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(logits / 0.9, dim=-1)
    torch.testing.assert_close(token_entropy(logits, 0.9), -(logp.exp() * logp).sum(-1))


def test_token_logprobs_from_logits_applies_temperature():
    logits = t([[0.0, 0.7, 1.4]])
    # softmax of [0, 1, 2] (logits / 0.7): log p(token 2) = 2 - log(1 + e + e²)
    expected = 2.0 - math.log(1 + math.e + math.e**2)
    assert float(token_logprobs_from_logits(logits, t([2], torch.int64), 0.7)[0]) == pytest.approx(expected, abs=1e-6)
