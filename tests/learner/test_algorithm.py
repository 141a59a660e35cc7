"""The RL step written once over the backend interface (actors/learner/algorithm.py), followed by hand.

`UnigramBackend` is a complete `LearnerBackend` whose policy ignores context: log π(y) =
log softmax(θ / T)[y] for one parameter vector θ, trained by plain SGD. Every update it takes can be
worked out on paper, so the two-update example below checks the loss, the clip counts, the gradient
and the weights of the RL step against numbers derived in the comments. It is also the smallest
answer to "what does a new backend have to write": model code only.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from actors.learner.algorithm import Trainer, rl_step
from actors.learner.backend import LearnerBackend, LossFn, PolicyOutput
from actors.learner.batch import MicroBatch, PackedBatch, micro_batches, mini_batches, pack
from actors.learner.data_parallel import DataParallel
from configs import AlgoConfig
from protocols import TrainBatch

VOCAB = 3


class UnigramBackend(LearnerBackend):
    """log π(y | anything) = log softmax(θ / T)[y]; SGD at `lr` without clipping. Records every
    forward_backward call as (micro-batches, forward_only)."""

    def __init__(self, lr: float, micro_batch_tokens: int) -> None:
        self.theta = torch.zeros(VOCAB, requires_grad=True)
        self.lr, self.micro_batch_tokens = lr, micro_batch_tokens
        self.dp = DataParallel(1, 0)
        self.calls: list[tuple[int, bool]] = []

    def pack(self, batch: TrainBatch) -> PackedBatch:
        return pack(batch, "cpu", vocab_size=VOCAB, max_seq_len=64)

    def forward_backward(
        self,
        packed: PackedBatch,
        micro_batches: Sequence[MicroBatch],
        loss_fn: LossFn,
        *,
        temperature: float,
        forward_only: bool = False,
        reference: bool = False,
    ) -> list[Any]:
        assert not reference, "no KL term in these tests"
        self.calls.append((len(micro_batches), forward_only))
        reports = []
        for mb in micro_batches:
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                logp = torch.log_softmax(self.theta / temperature, dim=-1)
                targets = packed.targets[mb.positions]
                entropy = -(logp.exp() * logp).sum().detach()
                loss, report = loss_fn(mb, PolicyOutput(logp[targets], functools.partial(entropy.expand, len(targets))))
                if not forward_only:
                    loss.backward()
            reports.append(report)
        return reports

    def zero_grad(self) -> None:
        self.theta.grad = None

    def step(self, lr: float | None = None) -> float:
        grad = self.theta.grad if self.theta.grad is not None else torch.zeros_like(self.theta)
        with torch.no_grad():
            self.theta -= (self.lr if lr is None else lr) * grad
        return float(grad.norm())

    def named_weights(self):
        yield "theta", self.theta.detach()

    def save_checkpoint(self, path: Path) -> None:
        Path(path).mkdir(parents=True)
        torch.save(self.theta.detach().clone(), Path(path) / "theta.pt")

    def load_checkpoint(self, path: Path) -> None:
        with torch.no_grad():
            self.theta.copy_(torch.load(Path(path) / "theta.pt"))

    def export_hf(self, path: Path) -> None:
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True)
        save_file({"theta": self.theta.detach().clone()}, str(Path(path) / "model.safetensors"))


def unigram_batch(seqs: list[tuple[list[int], list[float], float]]) -> TrainBatch:
    """Sequences of (tokens, behaviour logprobs, advantage); the first token is the prompt, the rest is
    the response (loss-masked)."""
    tokens = np.concatenate([np.asarray(t, np.int64) for t, _, _ in seqs])
    mask = np.concatenate([np.arange(len(t)) > 0 for t, _, _ in seqs])
    behaviour = np.concatenate([np.asarray([0.0, *b], np.float32) for _, b, _ in seqs])
    return TrainBatch(
        version=0,
        episode_ids=[f"ep{i}" for i in range(len(seqs))],
        tokens=tokens,
        cu_seqlens=np.concatenate([[0], np.cumsum([len(t) for t, _, _ in seqs])]).astype(np.int64),
        loss_mask=mask,
        behaviour_logprobs=behaviour,
        advantages=np.asarray([a for _, _, a in seqs], np.float32),
        versions=np.where(mask, 0, -1).astype(np.int64),
    )


# ------------------------------------------------------------------- the two-update example
#
# θ starts at 0, so π_prox = (1/3, 1/3, 1/3) on every token; T = 1, SGD with lr = 1, ε = (0.2, 0.28),
# C = 1.5, δ = 0.5. The prompt is token 2. Three sequences, five response tokens:
#   seq 0: responds 0, 0 with A = +1; μ = 1/3 and 1/6, so ρ = 1 and 2, w = 1 and min(2, C) = 1.5
#          (truncated); D = (0 + ln 2)/2 = 0.347 <= δ: kept
#   seq 1: responds 0, 1 with A = +1, μ = 1/3 (w = 1)
#   seq 2: responds 1 with A = -1, μ = 1/3 (w = 1)
# Two mini-batches of about equal kept tokens (2, 2, 1 by sequence): {seq 0} and {seq 1, seq 2}.
#
# Update 1, {seq 0}, normaliser 2, r = 1 everywhere: loss1 = -(1·1 + 1.5·1)/2 = -1.25.
#   ∂r/∂θ for token 0 = r·(e_0 - π) = (2/3, -1/3, -1/3), so g1 = -1.25·(2/3, -1/3, -1/3)
#   = (-5/6, 5/12, 5/12), |g1| = √150/12 = 1.020621; θ1 = -g1 = (5/6, -5/12, -5/12).
# Update 2, {seq 1, seq 2}, normaliser 3: π1 = softmax(θ1) = (0.635724, 0.182138, 0.182138), so
#   r(0) = 3·0.635724 = 1.907172 > 1 + 0.28: A > 0, clipped high: term -1.28, no gradient;
#   r(1) = 3·0.182138 = 0.546414, A = +1: min(0.546, 0.8) = 0.546 (not clipped): term -0.546414;
#   r(1) = 0.546414 < 1 - 0.2, A = -1: min(-0.546, -0.8) = -0.8, clipped low: term +0.8, no gradient.
#   loss2 = (-1.28 - 0.546414 + 0.8)/3 = -0.342138.
#   Only the unclipped token carries gradient: g2 = -(1/3)·r(1)·(e_1 - π1) = -π1(1)·(e_1 - π1)
#   = (0.115789, -0.148964, 0.033174), |g2| = 0.191567; θ2 = θ1 - g2 = (0.717544, -0.267703, -0.449841).
# The step reports the mean loss of its updates, (-1.25 - 0.342138)/2 = -0.796069, the mean grad
# norm (1.020621 + 0.191567)/2 = 0.606094, and clip counts over the 2 + 3 token-updates: 1 low and
# 1 high of 5. After the last update π2 = softmax(θ2) = (0.593639, 0.221633, 0.184728): the k3
# estimate of KL(π_prox ‖ π2) over the five kept tokens (three 0s, two 1s), r - 1 - ln r with
# r = 3·π2(y), is (3·k(1.780916) + 2·k(0.664900))/5 = 0.151480.

HAND_ALGO = AlgoConfig(ppo_minibatches=2, ppo_epochs=1, eps_low=0.2, eps_high=0.28, is_cap=1.5, mirrorpop_delta=0.5)
THIRD, SIXTH = math.log(1 / 3), math.log(1 / 6)
HAND_BATCH = unigram_batch(
    [([2, 0, 0], [THIRD, SIXTH], 1.0), ([2, 0, 1], [THIRD, THIRD], 1.0), ([2, 1], [THIRD], -1.0)]
)


@pytest.mark.parametrize(
    "micro_batch_tokens, calls",
    [
        (64, [(1, True), (1, False), (1, False), (1, True)]),  # one packed row per pass
        (3, [(3, True), (1, False), (2, False), (3, True)]),  # every sequence a micro-batch of its own
    ],
)
def test_two_updates_by_hand(micro_batch_tokens, calls):
    backend = UnigramBackend(lr=1.0, micro_batch_tokens=micro_batch_tokens)
    result = rl_step(backend, HAND_BATCH, HAND_ALGO, temperature=1.0)

    # π_prox pass, update 1, update 2, drift pass: rl_step hands the backend whole passes
    assert backend.calls == calls
    assert result.metrics["updates"] == 2 and result.trained_tokens == 5
    assert result.loss == pytest.approx(-0.796069, abs=1e-6)
    assert result.grad_norm == pytest.approx(0.606094, abs=1e-6)
    assert result.metrics["grad_norm_max"] == pytest.approx(1.020621, abs=1e-6)
    m = result.metrics
    assert (m["clip_fraction"], m["clip_low_fraction"], m["clip_high_fraction"]) == pytest.approx((0.4, 0.2, 0.2))
    # the gradient of the last update, and the weights after both
    torch.testing.assert_close(backend.theta.grad, torch.tensor([0.115789, -0.148964, 0.033174]), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        backend.theta.detach(), torch.tensor([0.717544, -0.267703, -0.449841]), atol=1e-6, rtol=0
    )
    assert m["approx_kl"] == pytest.approx(0.151480, abs=1e-6)
    # MirrorPop and importance weights, once per batch: w = 1, 1.5, 1, 1, 1; one of five truncated
    assert (m["kept_fraction"], m["is_truncated_fraction"], m["is_weight_mean"]) == pytest.approx((1.0, 0.2, 1.1))
    assert m["entropy"] == pytest.approx(math.log(3), abs=1e-6)  # π_prox is uniform
    assert m["response_length"] == pytest.approx(5 / 3)


def test_one_update_never_clips():
    """With a single update per batch r_t ≡ 1: the clip cannot act (the reason for mini-batches)."""
    backend = UnigramBackend(lr=1.0, micro_batch_tokens=64)
    one = AlgoConfig(ppo_minibatches=1, eps_low=0.2, eps_high=0.28, is_cap=1.5, mirrorpop_delta=0.5)
    result = rl_step(backend, HAND_BATCH, one, temperature=1.0)
    assert result.metrics["updates"] == 1 and result.metrics["clip_fraction"] == 0.0
    # the whole batch in one token mean: -(1 + 1.5 + 1 + 1 - 1)/5 = -0.7
    assert result.loss == pytest.approx(-0.7, abs=1e-6)


def test_epochs_repeat_the_mini_batches_against_the_same_proximal_policy():
    backend = UnigramBackend(lr=1.0, micro_batch_tokens=64)
    two_passes = AlgoConfig(
        ppo_minibatches=2, ppo_epochs=2, eps_low=0.2, eps_high=0.28, is_cap=1.5, mirrorpop_delta=0.5
    )
    result = rl_step(backend, HAND_BATCH, two_passes, temperature=1.0)
    assert result.metrics["updates"] == 4
    assert backend.calls == [(1, True)] + [(1, False)] * 4 + [(1, True)]
    # the third update sees seq 0 again with π_prox still uniform: r(0) = 3·π(0) is far above 1.28 by then
    assert result.metrics["clip_high_fraction"] > 0.2


def test_a_batch_mirrorpop_empties_takes_no_update():
    backend = UnigramBackend(lr=1.0, micro_batch_tokens=64)
    far = unigram_batch([([2, 0, 0], [-5.0, -5.0], 1.0)])  # D = 5 - ln 3 > δ
    result = rl_step(backend, far, HAND_ALGO, temperature=1.0)
    assert result.metrics["skipped"] == 1.0 and result.metrics["updates"] == 0 and result.trained_tokens == 0
    assert backend.calls == [(1, True)] and torch.equal(backend.theta.detach(), torch.zeros(VOCAB))


def test_the_token_bound_masks_a_token_and_the_step_trains_the_rest():
    # HAND_BATCH's seq 0 drifts ln 2 = 0.693 on its second token: δ_tok = 0.5 masks it (the truncated
    # one). One update over the four tokens left, r = 1, w = 1: -(1 + 1 + 1 - 1)/4 = -0.5.
    backend = UnigramBackend(lr=1.0, micro_batch_tokens=64)
    bounded = AlgoConfig(ppo_minibatches=1, is_cap=1.5, mirrorpop_delta=0.5, mirrorpop_token_delta=0.5)
    result = rl_step(backend, HAND_BATCH, bounded, temperature=1.0)
    assert result.trained_tokens == 4 and result.dropped == ()
    assert result.loss == pytest.approx(-0.5, abs=1e-6)
    m = result.metrics
    assert (m["mirrorpop_token_masked"], m["mirrorpop_dropped"], m["kept_fraction"]) == (1.0, 0.0, 1.0)
    assert (m["is_weight_mean"], m["is_truncated"]) == pytest.approx((1.0, 0.0))


def test_with_mirrorpop_switched_off_a_far_off_batch_trains():
    backend = UnigramBackend(lr=1.0, micro_batch_tokens=64)
    far = unigram_batch([([2, 0, 0], [-5.0, -5.0], 1.0)])  # D = 5 - ln 3 = 3.90, each token 3.90 off
    off = AlgoConfig(ppo_minibatches=1, is_cap=1.5, mirrorpop_delta=None, mirrorpop_token_delta=None)
    result = rl_step(backend, far, off, temperature=1.0)
    assert result.trained_tokens == 2 and result.metrics["updates"] == 1
    assert (result.metrics["mirrorpop_dropped"], result.metrics["mirrorpop_token_masked"]) == (0.0, 0.0)
    # w = min(e^3.90, 1.5) = 1.5 on both tokens, r = 1, A = 1: -(1.5 + 1.5)/2
    assert result.loss == pytest.approx(-1.5, abs=1e-6)


def test_trainer_validates_the_temperature():
    with pytest.raises(ValueError, match="temperature"):
        Trainer(UnigramBackend(lr=1.0, micro_batch_tokens=64), HAND_ALGO, temperature=0.0)


# ---------------------------------------------------------------------- mini- and micro-batches


def test_mini_batches_are_consecutive_and_balanced_by_tokens():
    split = lambda tokens, count: [part.tolist() for part in mini_batches(np.asarray(tokens), count)]
    assert split([2, 2, 1], 2) == [[0], [1, 2]]
    assert split([5, 5, 5, 5], 4) == [[0], [1], [2], [3]]
    assert split([5, 5, 5, 5, 5, 5, 5, 5], 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split([5, 0, 5, 0, 5, 5], 2) == [[0, 2], [4, 5]]  # sequences without kept tokens are left out
    assert split([1, 1], 4) == [[0], [1]]  # never an empty mini-batch
    assert split([30, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split([0, 0], 3) == []


def test_micro_batches_of_chosen_sequences_break_at_gaps():
    cu = np.array([0, 3, 5, 9, 12])
    spans = lambda seqs, max_tokens: [
        (m.start, m.stop, m.first_seq, m.end_seq) for m in micro_batches(cu, max_tokens, seqs)
    ]
    assert spans([0, 1, 2, 3], 100) == [(0, 12, 0, 4)]
    assert spans([0, 2, 3], 100) == [(0, 3, 0, 1), (5, 12, 2, 4)]  # sequence 1 is not in the row
    assert spans([1, 3], 100) == [(3, 5, 1, 2), (9, 12, 3, 4)]
    assert spans([0, 1, 2], 5) == [(0, 5, 0, 2), (5, 9, 2, 3)]
