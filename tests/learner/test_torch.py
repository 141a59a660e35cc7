"""The torch learner backend on a tiny model, through the one RL step: batch alignment,
micro-batching, logprobs, steps, mini-batch normalisation, KL, checkpoints and HF export
(actors/learner/{batch,algorithm,torch_backend,checkpoint,backends}.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch

from actors.learner import checkpoint as ckpt
from actors.learner import torch_backend
from actors.learner.algorithm import Trainer
from actors.learner.backends import make_backend, make_trainer
from actors.learner.batch import BatchError, micro_batches, pack
from actors.learner.checkpoint import CheckpointMeta, read_latest, write_checkpoint
from actors.learner.torch_backend import TorchBackend
from actors.policy.model import build_model
from configs import AlgoConfig, ConfigError, LearnerConfig, ModelConfig
from protocols import TrainBatch

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=259)
T = 0.7


def train_batch(lengths, prompt_lengths, advantages, seed=0, behaviour=None) -> TrainBatch:
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    mask = np.concatenate([np.arange(length) >= p for length, p in zip(lengths, prompt_lengths, strict=True)])
    return TrainBatch(
        version=0,
        episode_ids=[f"ep{i}" for i in range(len(lengths))],
        tokens=rng.integers(0, TINY.vocab_size, n).astype(np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.zeros(n, np.float32) if behaviour is None else behaviour,
        advantages=np.asarray(advantages, np.float32),
        versions=np.where(mask, 0, -1).astype(np.int64),
    )


def backend(algo: AlgoConfig | None = None, **learner) -> Trainer:
    """The torch backend under the RL step (the default algorithm unless `algo`)."""
    return Trainer(TorchBackend(TINY, LearnerConfig(**{"lr": 1e-3, **learner})), algo or AlgoConfig(), temperature=T)


def on_policy(b: Trainer, batch: TrainBatch, noise=None) -> TrainBatch:
    """The batch with μ = the backend's current logprobs (+ noise) on its gradient-carrying tokens."""
    lp = b.logprobs(batch, T).numpy() + (0 if noise is None else noise)
    return dataclasses.replace(batch, behaviour_logprobs=np.where(batch.loss_mask, lp, 0).astype(np.float32))


# ------------------------------------------------------------------------------------- packing


def test_pack_aligns_everything_to_the_predicting_position():
    # Two sequences: [10 11 | 12 13 14] (prompt 10 11, response 12..14) and [20 | 21 22].
    batch = TrainBatch(
        version=0,
        episode_ids=["a", "b"],
        tokens=np.array([10, 11, 12, 13, 14, 20, 21, 22]),
        cu_seqlens=np.array([0, 5, 8]),
        loss_mask=np.array([0, 0, 1, 1, 1, 0, 1, 1], bool),
        behaviour_logprobs=np.array([0, 0, -1, -2, -3, 0, -4, -5], np.float32),
        advantages=np.array([0.5, -2.0], np.float32),
        versions=np.zeros(8, np.int64),
    )
    p = pack(batch, "cpu", vocab_size=259, max_seq_len=64)
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert p.seq_index.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    # The logits at position t predict token t+1; a sequence's last position predicts nothing.
    assert p.targets.tolist() == [11, 12, 13, 14, 0, 21, 22, 0]
    assert p.grad_mask.tolist() == [False, True, True, True, False, True, True, False]
    assert p.behaviour_logprobs.tolist() == [0, -1, -2, -3, 0, -4, -5, 0]
    assert p.advantages.tolist() == [0.5] * 5 + [-2.0] * 3
    assert p.to_token_aligned(torch.arange(1.0, 9.0)).tolist() == [0, 1, 2, 3, 4, 0, 6, 7]


def test_micro_batches_split_between_sequences_only():
    cu = np.array([0, 3, 5, 9])
    spans = lambda max_tokens: [(m.start, m.stop) for m in micro_batches(cu, max_tokens)]
    assert spans(100) == [(0, 9)]
    assert spans(5) == [(0, 5), (5, 9)]
    assert spans(4) == [(0, 3), (3, 5), (5, 9)]
    assert spans(2) == [(0, 3), (3, 5), (5, 9)]  # a longer sequence is a micro-batch of its own
    assert spans(1) == spans(2)
    # Empty sequences never make an empty micro-batch.
    assert [(m.start, m.stop) for m in micro_batches(np.array([0, 0, 4, 4, 6]), 4)] == [(0, 4), (4, 6)]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokens": np.array([1, 2, 999])}, "token ids"),
        ({"cu_seqlens": np.array([0, 2])}, "malformed"),
        ({"advantages": np.array([np.nan], np.float32)}, "finite"),
    ],
)
def test_bad_batches_are_refused_and_the_backend_keeps_working(change, message):
    b = backend()
    good = train_batch([3], [1], [1.0])
    with pytest.raises(BatchError, match=message):
        b.train_step(dataclasses.replace(good, **change))
    assert b.train_step(on_policy(b, good)).trained_tokens == 2


# ---------------------------------------------------------------------------- backend numerics


def test_logprobs_equal_a_plain_forward_per_sequence():
    b = backend()
    batch = train_batch([6, 11, 1, 9], [2, 3, 0, 4], [1, 1, 1, 1])
    got = b.logprobs(batch, T)
    model = build_model(TINY)
    cu = batch.cu_seqlens
    for s in range(len(cu) - 1):
        ids = torch.from_numpy(batch.tokens[cu[s] : cu[s + 1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float() / T, dim=-1)
        expected = torch.cat([torch.zeros(1), logp[:-1].gather(1, ids[1:, None])[:, 0]])
        torch.testing.assert_close(got[cu[s] : cu[s + 1]], expected, atol=1e-5, rtol=0)


def test_micro_batching_does_not_change_the_gradient():
    batch = train_batch([7, 12, 5, 9, 14, 6], [2, 3, 1, 4, 5, 2], [1.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    rng = np.random.default_rng(1)
    noise = rng.normal(0, 0.1, len(batch.tokens)).astype(np.float32)
    noise[batch.cu_seqlens[4] : batch.cu_seqlens[5]] += 2.0  # sequence 4 drifts: MirrorPop drops it
    one_update = AlgoConfig(ppo_minibatches=1)
    small = backend(one_update, micro_batch_tokens=16, grad_clip=0.0)
    large = backend(one_update, micro_batch_tokens=4096, grad_clip=0.0)
    batch = on_policy(small, batch, noise)
    assert len(micro_batches(batch.cu_seqlens, 16)) > 3
    r_small, r_large = small.train_step(batch), large.train_step(batch)
    assert r_small.trained_tokens == r_large.trained_tokens == len(batch.tokens) - 17 - 9
    assert r_small.metrics["kept_fraction"] == pytest.approx(5 / 6)
    assert r_small.loss == pytest.approx(r_large.loss, abs=1e-6)
    for (name, p_small), p_large in zip(
        small.backend.model.named_parameters(), large.backend.model.parameters(), strict=True
    ):
        torch.testing.assert_close(p_small.grad, p_large.grad, atol=1e-6, rtol=0, msg=name)


def subset(batch: TrainBatch, seqs: list[int]) -> TrainBatch:
    """The batch of only the sequences `seqs`."""
    cu = batch.cu_seqlens
    take = lambda a: np.concatenate([a[cu[s] : cu[s + 1]] for s in seqs])
    return TrainBatch(
        version=0,
        episode_ids=[batch.episode_ids[s] for s in seqs],
        tokens=take(batch.tokens),
        cu_seqlens=np.concatenate([[0], np.cumsum([cu[s + 1] - cu[s] for s in seqs])]).astype(np.int64),
        loss_mask=take(batch.loss_mask),
        behaviour_logprobs=take(batch.behaviour_logprobs),
        advantages=batch.advantages[seqs],
        versions=take(batch.versions),
    )


def test_each_update_is_a_token_mean_over_its_own_mini_batch():
    """Normalisation is per mini-batch: with two mini-batches (5 + 3 and 4 + 6 response tokens) the
    step's loss is the mean of the two token means, and the last update's gradient is the one a
    single update on the second mini-batch alone takes. lr = 0 keeps π_θ = π_prox = μ throughout, so
    w = r = 1 and each update's loss is minus its mini-batch's mean token advantage."""
    batch = train_batch([8, 6, 7, 9], [3, 3, 3, 3], [1.0, -0.5, 2.0, -1.0])
    two = backend(AlgoConfig(ppo_minibatches=2), lr=0.0, grad_clip=0.0)
    batch = on_policy(two, batch)
    result = two.train_step(batch)
    assert result.metrics["updates"] == 2 and result.trained_tokens == 18
    # -(5·1 + 3·(-0.5))/8 = -0.4375 and -(4·2 + 6·(-1))/10 = -0.2; over the whole batch it would be -5.5/18
    assert result.loss == pytest.approx((-0.4375 - 0.2) / 2, abs=1e-6)
    alone = [backend(AlgoConfig(ppo_minibatches=1), lr=0.0, grad_clip=0.0) for _ in range(2)]
    losses = [b.train_step(subset(batch, seqs)).loss for b, seqs in zip(alone, ([0, 1], [2, 3]), strict=True)]
    assert losses == pytest.approx([-0.4375, -0.2], abs=1e-6)
    for (name, p_two), p_alone in zip(
        two.backend.model.named_parameters(), alone[1].backend.model.parameters(), strict=True
    ):
        torch.testing.assert_close(p_two.grad, p_alone.grad, atol=1e-7, rtol=1e-5, msg=name)


def response_logprob(b: Trainer, batch: TrainBatch, seq: int) -> float:
    lp, cu = b.logprobs(batch, T), batch.cu_seqlens
    return float((lp * torch.from_numpy(batch.loss_mask))[cu[seq] : cu[seq + 1]].sum())


def test_positive_advantage_raises_the_sequence_logprob_and_lr_zero_changes_nothing():
    b = backend(lr=3e-3)
    batch = train_batch([8, 8], [3, 3], [1.0, -1.0])
    before = [response_logprob(b, batch, s) for s in (0, 1)]
    for _ in range(4):
        result = b.train_step(on_policy(b, batch))
        assert result.trained_tokens == 10 and result.grad_norm > 0
    after = [response_logprob(b, batch, s) for s in (0, 1)]
    assert after[0] > before[0] + 0.1 and after[1] < before[1] - 0.1

    frozen = backend(lr=0.0)
    weights = {k: v.clone() for k, v in frozen.backend.model.state_dict().items()}
    frozen.train_step(on_policy(frozen, batch))
    assert all(torch.equal(weights[k], v) for k, v in frozen.backend.model.state_dict().items())


def test_a_batch_mirrorpop_empties_takes_no_step():
    b = backend()
    batch = train_batch([8], [3], [1.0])
    batch = on_policy(b, batch, np.full(8, 5.0, np.float32))
    weights = {k: v.clone() for k, v in b.backend.model.state_dict().items()}
    result = b.train_step(batch)
    assert (result.trained_tokens, result.metrics["skipped"], result.metrics["kept_fraction"]) == (0, 1.0, 0.0)
    assert all(torch.equal(weights[k], v) for k, v in b.backend.model.state_dict().items())


def test_sft_steps_lower_the_cross_entropy_at_the_given_lr():
    batch = train_batch([10, 6], [4, 2], [0.0, 0.0])
    b = backend(lr=0.0)  # the optimizer's own lr is 0: only the per-step lr moves the weights
    losses = [b.sft_step(batch, lr=1e-2).loss for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1
    assert all(g["lr"] == 0.0 for g in b.backend.optimizer.param_groups)
    weights = {k: v.clone() for k, v in b.backend.model.state_dict().items()}
    b.sft_step(batch)
    assert all(torch.equal(weights[k], v) for k, v in b.backend.model.state_dict().items())


def test_kl_term_runs_against_the_initial_model():
    b = make_trainer(
        TINY, LearnerConfig(lr=1e-2), AlgoConfig(kl_coef=0.1, ppo_minibatches=1), temperature=T, device="cpu"
    )
    batch = train_batch([8], [3], [1.0])
    first = b.train_step(on_policy(b, batch))
    second = b.train_step(on_policy(b, batch))
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-9) and second.metrics["kl"] > 0
    # several updates in one batch: the second and later ones see a policy the first moved
    many = make_trainer(
        TINY, LearnerConfig(lr=1e-2), AlgoConfig(kl_coef=0.1, ppo_minibatches=2), temperature=T, device="cpu"
    )
    assert many.train_step(on_policy(many, train_batch([8, 9], [3, 3], [1.0, -1.0]))).metrics["kl"] > 0


# ------------------------------------------------------------------------ weights and checkpoints


def test_named_weights_are_the_engine_state_dict():
    engine_state = build_model(TINY).state_dict()
    named = list(backend().named_weights())
    assert [n for n, _ in named] == list(engine_state)
    assert all(t.shape == engine_state[n].shape and t.dtype == engine_state[n].dtype for n, t in named)


def test_export_hf_loads_in_transformers_with_equal_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    b = backend(lr=1e-2)
    b.train_step(on_policy(b, train_batch([8], [3], [1.0])))
    b.export_hf(tmp_path / "hf")
    assert list((tmp_path / "hf").glob("*.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ours = b.backend.model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, ours[name]), name


def test_checkpoint_round_trip_restores_model_optimizer_and_rng(tmp_path):
    batch = train_batch([9, 7], [3, 2], [1.0, -1.0])
    a = backend()
    a.train_step(on_policy(a, batch))  # the optimizer now has moments and a step count
    write_checkpoint(tmp_path, a, CheckpointMeta(version=7, step=1, time=123.0))
    a_next = a.train_step(on_policy(a, batch))
    a_draws = (torch.rand(3), np.random.rand(3), random.random())

    b = backend()
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    state_dir, meta = read_latest(tmp_path)
    assert meta == CheckpointMeta(version=7, step=1, time=123.0)
    b.load_checkpoint(state_dir)
    b_next = b.train_step(on_policy(b, batch))
    b_draws = (torch.rand(3), np.random.rand(3), random.random())

    assert b_next.loss == a_next.loss and b_next.grad_norm == a_next.grad_norm
    assert all(torch.equal(v, a.backend.model.state_dict()[k]) for k, v in b.backend.model.state_dict().items())
    assert torch.equal(a_draws[0], b_draws[0]) and np.array_equal(a_draws[1], b_draws[1]) and a_draws[2] == b_draws[2]


def test_a_crash_mid_checkpoint_never_moves_latest(tmp_path, monkeypatch):
    b = backend()
    first = write_checkpoint(tmp_path, b, CheckpointMeta(version=1, step=1, time=1.0))
    assert read_latest(tmp_path)[0] == first / "state"

    def crash(_path):
        raise OSError("disk full")

    # Crash inside the backend's save (model and optimizer written, RNG not).
    monkeypatch.setattr(torch_backend, "save_rng", crash)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path, b, CheckpointMeta(version=2, step=2, time=2.0))
    monkeypatch.undo()
    assert read_latest(tmp_path)[1].step == 1
    assert not (tmp_path / "checkpoints" / "step-000002").exists()

    # Crash after the checkpoint directory is in place but before `latest` moves.
    monkeypatch.setattr(ckpt, "_write_marker", lambda root, name: crash(root))
    with pytest.raises(OSError):
        write_checkpoint(tmp_path, b, CheckpointMeta(version=2, step=2, time=2.0))
    monkeypatch.undo()
    assert read_latest(tmp_path)[1].step == 1

    # The next write sweeps the debris and succeeds.
    second = write_checkpoint(tmp_path, b, CheckpointMeta(version=2, step=2, time=2.0))
    assert read_latest(tmp_path) == (second / "state", CheckpointMeta(version=2, step=2, time=2.0))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001", "step-000002"]
    assert json.loads((second / "meta.json").read_text())["version"] == 2
    with pytest.raises(FileExistsError):  # the latest checkpoint is never overwritten in place
        write_checkpoint(tmp_path, b, CheckpointMeta(version=3, step=2, time=3.0))
    assert read_latest(tmp_path)[1].version == 2
    assert read_latest(tmp_path / "elsewhere") is None


# ------------------------------------------------------------------------------------ selection


def test_make_backend_picks_torch_and_refuses_unknown_names():
    made = make_backend(TINY, LearnerConfig(), device="cpu")
    assert isinstance(made, TorchBackend) and made.reference is None
    trainer = make_trainer(TINY, LearnerConfig(), AlgoConfig(kl_coef=0.1), temperature=T, device="cpu")
    assert isinstance(trainer.backend, TorchBackend) and trainer.backend.reference is not None
    assert trainer.temperature == T
    with pytest.raises(ConfigError, match="unknown backend"):
        make_backend(TINY, LearnerConfig(backend="jax"), device="cpu")


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_bf16_autocast_training_on_cuda(tmp_path):
    bf16 = dataclasses.replace(TINY, dtype="bfloat16")
    gpu = make_trainer(bf16, LearnerConfig(lr=3e-3), AlgoConfig(), temperature=T, device="cuda")
    cpu = make_trainer(bf16, LearnerConfig(lr=3e-3), AlgoConfig(), temperature=T, device="cpu")
    # A seeded init depends on the device it runs on: start both from the CPU model's weights.
    gpu.backend.model.load_state_dict(cpu.backend.model.state_dict())
    assert all(p.dtype == torch.float32 and p.is_cuda for p in gpu.backend.model.parameters())  # fp32 master weights
    batch = train_batch([40, 25, 60], [10, 5, 20], [1.0, -1.0, 0.5])
    torch.testing.assert_close(gpu.logprobs(batch, T), cpu.logprobs(batch, T), atol=0.1, rtol=0)

    before = response_logprob(gpu, batch, 0)
    for _ in range(3):
        result = gpu.train_step(on_policy(gpu, batch))
        assert result.trained_tokens == 90 and math.isfinite(result.grad_norm) and result.grad_norm > 0
    assert response_logprob(gpu, batch, 0) > before
    assert {t.dtype for _, t in gpu.named_weights()} == {torch.bfloat16}

    write_checkpoint(tmp_path, gpu, CheckpointMeta(version=3, step=3, time=0.0))
    expected = gpu.train_step(on_policy(gpu, batch)), torch.rand(4, device="cuda")
    restored = make_trainer(bf16, LearnerConfig(lr=3e-3), AlgoConfig(), temperature=T, device="cuda")
    restored.load_checkpoint(read_latest(tmp_path)[0])
    got = restored.train_step(on_policy(restored, batch)), torch.rand(4, device="cuda")
    assert got[0].loss == expected[0].loss and torch.equal(got[1], expected[1])
