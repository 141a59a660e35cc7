"""The torch and megatron backends take the same RL step on the same batch, through the one `rl_step`
(one GPU; megatron-core does not run on CPU):

    pytest -m gpu tests/learner/test_backends_gpu.py -s

Both start from the same seeded HF init in float32 (megatron-core trains float32 parameters too, so
bf16 rounding does not blur the comparison) and take one step on the same batch: one sequence drifted
past MirrorPop's δ, two mini-batch updates (so the second sees r_t ≠ 1) and a KL term (so both run
their reference model). The algorithm is the same code; only the model code differs, so the loss,
grad norm, MirrorPop's verdict, the clip and KL figures and the logprobs after the step must agree to
float32 rounding. `-s` prints the two side by side.
"""

from __future__ import annotations

import dataclasses

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def test_torch_and_megatron_take_the_same_rl_step():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core")
    from actors.learner.backends import make_trainer
    from configs import AlgoConfig, LearnerConfig
    from launch.bench.megatron_rows import SMALL, T, make_batch, with_behaviour

    model = dataclasses.replace(SMALL, dtype="float32")
    learner = LearnerConfig(lr=1e-3, micro_batch_tokens=1024, grad_clip=1.0)
    algo = AlgoConfig(ppo_minibatches=2, kl_coef=0.05)
    trainers = {
        name: make_trainer(model, dataclasses.replace(learner, backend=name), algo, temperature=T, device="cuda")
        for name in ("torch", "megatron")
    }
    batch = make_batch(model, [300, 517, 128, 700, 64], seed=1)
    before = {name: t.logprobs(batch, T) for name, t in trainers.items()}
    train = with_behaviour(batch, before["torch"].numpy(), drifted=2, seed=5)
    results = {name: t.train_step(train) for name, t in trainers.items()}
    after = {name: t.logprobs(batch, T) for name, t in trainers.items()}

    a, b = results["torch"], results["megatron"]
    keys = ["kept_fraction", "updates", "clip_fraction", "is_weight_mean", "entropy", "kl", "approx_kl"]
    print(f"\n{'':22s} {'torch':>12s} {'megatron':>12s}")
    print(f"{'max|Δ logprob| before':22s} {float((before['torch'] - before['megatron']).abs().max()):>25.3g}")
    for key, x, y in [
        ("loss", a.loss, b.loss),
        ("grad_norm", a.grad_norm, b.grad_norm),
        ("trained_tokens", a.trained_tokens, b.trained_tokens),
    ] + [(k, a.metrics[k], b.metrics[k]) for k in keys]:
        print(f"{key:22s} {x:>12.6g} {y:>12.6g}")
    print(f"{'max|Δ logprob| after':22s} {float((after['torch'] - after['megatron']).abs().max()):>25.3g}")

    assert float((before["torch"] - before["megatron"]).abs().max()) < 1e-3  # the same initial weights
    assert a.trained_tokens == b.trained_tokens and a.metrics["kept_fraction"] == b.metrics["kept_fraction"] == 0.8
    assert a.metrics["updates"] == b.metrics["updates"] == 2
    assert b.loss == pytest.approx(a.loss, rel=1e-3, abs=1e-5)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-3)
    for key in ("is_weight_mean", "entropy", "kl", "approx_kl"):
        assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-2, abs=1e-6), key
    assert b.metrics["clip_fraction"] == pytest.approx(a.metrics["clip_fraction"], abs=0.01)
    assert a.metrics["kl"] > 1e-6  # the second update moved away from the reference
    assert float((after["torch"] - after["megatron"]).abs().max()) < 1e-2
