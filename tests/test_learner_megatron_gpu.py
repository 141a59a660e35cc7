"""The megatron backend on one GPU (`pytest -m gpu tests/test_learner_megatron_gpu.py`): weights go
HF -> megatron -> HF bit-exactly, logprobs match the HF model, a train step moves the weights and
MirrorPop drops a drifted sequence, export_hf reloads in transformers, checkpoints restore. The
TP/DP layouts need two GPUs: `torchrun --nproc-per-node 2 -m launch.bench.gpu_megatron`."""

from __future__ import annotations

import dataclasses
import math

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def backend():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core")
    from actors.learner.algorithm import Trainer
    from actors.learner.megatron.backend import MegatronBackend
    from launch.bench.gpu_megatron import SMALL, T
    from configs import AlgoConfig, LearnerConfig

    megatron = MegatronBackend(SMALL, LearnerConfig(backend="megatron", lr=1e-3, micro_batch_tokens=1024), device="cuda")
    return Trainer(megatron, AlgoConfig(), temperature=T)


@pytest.fixture(scope="module")
def batch():
    from launch.bench.gpu_megatron import SMALL, make_batch

    return make_batch(SMALL, [300, 517, 128, 700, 64], seed=1)


def test_weights_round_trip_bit_exact(backend):
    from launch.bench.gpu_megatron import initial_weights, weights

    ref = initial_weights(backend.backend.device)
    got = weights(backend)
    assert set(got) == set(ref) - {"lm_head.weight"}
    for name, t in got.items():
        assert torch.equal(t, ref[name].float()), name


def test_logprobs_match_the_hf_model(backend, batch):
    from launch.bench.gpu_megatron import SMALL, T, hf_logits, token_logprobs

    ours = backend.logprobs(batch, T)
    theirs = token_logprobs(hf_logits(SMALL, batch, backend.backend.device), batch, T)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert float((ours - theirs).abs().mean()) < 2e-2


def test_export_reloads_in_transformers(backend, tmp_path):
    from transformers import AutoModelForCausalLM

    from launch.bench.gpu_megatron import weights

    backend.export_hf(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).state_dict()
    for name, t in weights(backend).items():
        assert torch.equal(reloaded[name].float(), t), name


def test_train_step_moves_weights_and_checkpoint_restores(backend, batch, tmp_path):
    from launch.bench.gpu_megatron import T, max_diff, weights, with_behaviour

    train = with_behaviour(batch, backend.logprobs(batch, T).numpy(), drifted=2, seed=5)
    before = weights(backend)
    backend.save_checkpoint(tmp_path / "ckpt")
    result = backend.train_step(train)
    assert math.isfinite(result.loss) and result.grad_norm > 0
    assert result.metrics["kept_fraction"] == pytest.approx(4 / 5)
    assert max_diff(before, weights(backend)) > 0
    backend.load_checkpoint(tmp_path / "ckpt")
    assert max_diff(before, weights(backend)) == 0
    skipped = backend.train_step(dataclasses.replace(train, loss_mask=train.loss_mask * False))
    assert skipped.metrics["skipped"] == 1.0 and max_diff(before, weights(backend)) == 0
