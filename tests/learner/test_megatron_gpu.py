"""The megatron backend on one GPU (`pytest -m gpu tests/learner/test_megatron_gpu.py`): weights go
HF -> megatron -> HF bit-exactly, logprobs match the HF model, a train step moves the weights and
MirrorPop drops a drifted sequence, export_hf reloads in transformers, checkpoints restore, the
compiled logprob kernels equal the full-vocabulary computation, and the kernel switches change no
result. The TP/PP/DP layouts need two GPUs: `torchrun --nproc-per-node 2 -m launch.bench.gpu_megatron`."""

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
    from configs import AlgoConfig, LearnerConfig
    from launch.bench.megatron_rows import SMALL, T

    megatron = MegatronBackend(
        SMALL, LearnerConfig(backend="megatron", lr=1e-3, micro_batch_tokens=1024), device="cuda"
    )
    return Trainer(megatron, AlgoConfig(), temperature=T)


@pytest.fixture(scope="module")
def batch():
    from launch.bench.megatron_rows import SMALL, make_batch

    return make_batch(SMALL, [300, 517, 128, 700, 64], seed=1)


def test_weights_round_trip_bit_exact(backend):
    from launch.bench.gpu_megatron import initial_weights
    from launch.bench.megatron_rows import weights

    ref = initial_weights(backend.backend.device)
    got = weights(backend)
    assert set(got) == set(ref) - {"lm_head.weight"}
    for name, t in got.items():
        assert torch.equal(t, ref[name].float()), name


def test_logprobs_match_the_hf_model(backend, batch):
    from launch.bench.gpu_megatron import hf_logits, token_logprobs
    from launch.bench.megatron_rows import SMALL, T

    ours = backend.logprobs(batch, T)
    theirs = token_logprobs(hf_logits(SMALL, batch, backend.backend.device), batch, T)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert float((ours - theirs).abs().mean()) < 2e-2


def test_export_reloads_in_transformers(backend, tmp_path):
    from transformers import AutoModelForCausalLM

    from launch.bench.megatron_rows import weights

    backend.export_hf(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).state_dict()
    for name, t in weights(backend).items():
        assert torch.equal(reloaded[name].float(), t), name


def test_train_step_moves_weights_and_checkpoint_restores(backend, batch, tmp_path):
    from launch.bench.megatron_rows import T, max_diff, weights, with_behaviour

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


def test_compiled_logprob_kernels_equal_the_full_vocabulary_ones():
    """The torch.compile'd chunk kernels (the default on a GPU) against fp32 log-softmax over the whole
    vocabulary: values and gradients, bf16 logits with padding columns, several chunks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from actors.learner.megatron.logprobs import VocabSlice, token_entropy, token_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, rows = 151_936, 3000
    logits = (4 * torch.randn(rows, vocab + 64, generator=g, device="cuda")).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    weights = torch.randn(rows, generator=g, device="cuda")
    full = logits.clone().requires_grad_(True)
    expected = torch.log_softmax(full[:, :vocab].float() / 0.7, -1).gather(1, targets[:, None])[:, 0]
    (expected * weights).sum().backward()
    leaf = logits.clone().requires_grad_(True)
    got = token_logprobs(leaf * 1, targets, 0.7, VocabSlice(0, vocab), chunk_rows=1024, compiled=True, overwrite=True)
    (got * weights).sum().backward()
    assert float((got - expected).abs().max()) < 1e-4
    # bf16 gradients: the same fp32 value may round to neighbouring bf16 numbers (one ulp is 2^-8 relative)
    torch.testing.assert_close(leaf.grad.float(), full.grad.float(), rtol=1e-2, atol=1e-7)
    p = torch.log_softmax(logits[:, :vocab].float() / 0.7, -1)
    entropy = token_entropy(logits, 0.7, VocabSlice(0, vocab), chunk_rows=1024, compiled=True)
    assert float((entropy + (p.exp() * p).sum(-1)).abs().max()) < 1e-3


def test_kernel_switches_change_speed_not_results(backend, batch):
    """Every `learner.megatron` switch off against every one on: the same logprobs (bf16 rounding)."""
    from actors.learner.megatron.model import Kernels
    from launch.bench.megatron_rows import T

    megatron = backend.backend
    try:
        megatron.kernels = Kernels(fused_logprobs=False, fused_swiglu=False, fused_rope=False)
        plain = backend.logprobs(batch, T)
        megatron.kernels = Kernels(fused_logprobs=True, fused_swiglu=True, fused_rope=True)
        fused = backend.logprobs(batch, T)
    finally:
        megatron.kernels = Kernels()
    assert float((plain - fused).abs().mean()) < 1e-2 and float((plain - fused).abs().max()) < 0.1


def test_fused_grad_accumulation_equals_the_hooks_add(backend, batch):
    """`fused_grad_accumulation` (bf16 GEMM inputs, product added into the fp32 main grads) against a
    bf16 weight grad added by DDP's hook, over the batch's micro-batches (test_megatron_grad_accumulation
    checks the same on CPU in fp32)."""
    from actors.learner.batch import micro_batches
    from actors.learner.megatron.model import Kernels

    megatron = backend.backend
    packed = megatron.pack(batch)
    micros = micro_batches(packed.cu_seqlens, megatron.micro_batch_tokens)
    assert len(micros) > 1  # the accumulation across micro-batches is part of what is compared

    def grads(fused: bool):
        megatron.kernels = Kernels(fused_grad_accumulation=fused)
        megatron.zero_grad()
        megatron.forward_backward(packed, micros, lambda mb, out: (out.logprobs.sum() * 1e-3, None), temperature=1.0)
        params = dict(megatron.gpt.named_parameters())
        marked = {n for n, p in params.items() if getattr(p, "grad_added_to_main_grad", False)}
        return {n: p.main_grad.clone() for n, p in params.items()}, marked

    try:
        (plain, plain_marked), (fused, fused_marked) = grads(False), grads(True)
    finally:
        megatron.kernels = Kernels()
        megatron.zero_grad()
    assert not plain_marked and len(fused_marked) >= 4 * megatron.shape.num_layers
    for name, ref in plain.items():
        scale = float(ref.abs().max())
        assert scale > 0, name
        # The hook's add sums each micro-batch's weight grad rounded to bf16 (2^-9 relative).
        assert float((fused[name] - ref).abs().max()) <= 1e-2 * scale, name


def test_fused_grad_clip_equals_megatrons_per_tensor_fallback():
    """`grad_clip`'s multi-tensor norm and scale against megatron's fallback on CUDA tensors."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from actors.learner.megatron import grad_clip

    g = torch.Generator(device="cuda").manual_seed(3)
    tensors = [torch.randn(n, device="cuda", generator=g) for n in (1000, 37, 3 * 4096, 5, 2048 * 64)]
    ours, _ = grad_clip.l2norm(0, None, [tensors], False)
    theirs, _ = local_multi_tensor_l2_norm(0, None, [tensors], False)
    assert ours.device.type == "cuda" and ours.shape == (1,)
    assert abs(float(ours) - float(theirs)) <= 1e-6 * float(theirs)
    clipped, reference = [t.clone() for t in tensors], [t.clone() for t in tensors]
    grad_clip.scale(0, None, [clipped, clipped], 0.37)
    local_multi_tensor_scale(0, None, [reference, reference], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(clipped, reference, strict=True))
