"""The chunked token logprobs and entropies of the megatron backend (actors/learner/megatron/logprobs.py)
against the plain full-vocabulary computation, on CPU: values and gradients within 1e-5, padding
columns left out, and nothing of size tokens × vocabulary in fp32 kept for the backward. The TP-split
version (all-reduces across ranks, a rank whose slice is all padding) runs through the backend in
tests/learner/test_megatron_mapping.py. The compiled kernels are checked here once, on micro-batches
of changing length (torch.compile runs on CPU too), and at the real vocabulary on the GPU
(tests/learner/test_megatron_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from actors.learner.megatron.logprobs import VocabSlice, token_entropy, token_logprobs

T = 0.7


def reference(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.log_softmax(logits[:, :vocab].float() / T, dim=-1).gather(1, targets[:, None])[:, 0]


def case(dtype: torch.dtype, rows: int = 37, vocab: int = 300, pad: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab + pad, generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.randn(rows, generator=g)  # a loss that weighs rows differently
    return logits, targets, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 1000])
@pytest.mark.parametrize("overwrite", [False, True])
def test_chunked_logprobs_equal_the_full_vocabulary_ones(dtype, chunk_rows, overwrite):
    logits, targets, weights = case(dtype)
    full = logits.clone().requires_grad_(True)
    expected = reference(full, targets, 300)
    (expected * weights).sum().backward()

    leaf = logits.clone().requires_grad_(True)
    got = token_logprobs(
        leaf * 1, targets, T, VocabSlice(start=0, valid=300), chunk_rows=chunk_rows, overwrite=overwrite
    )  # `* 1`: a non-leaf, as the output layer's logits are
    (got * weights).sum().backward()
    assert got.dtype == torch.float32
    assert float((got - expected).abs().max()) <= 1e-5
    assert float((leaf.grad.float() - full.grad.float()).abs().max()) <= 1e-5
    assert torch.count_nonzero(leaf.grad[:, 300:]) == 0  # padding columns get no gradient


def test_entropy_equals_the_full_vocabulary_one():
    logits, _, _ = case(torch.bfloat16, rows=50)
    p = torch.log_softmax(logits[:, :300].float() / T, dim=-1)
    expected = -(p.exp() * p).sum(-1)
    got = token_entropy(logits, T, VocabSlice(start=0, valid=300), chunk_rows=16)
    assert float((got - expected).abs().max()) <= 1e-5


def test_nothing_of_tokens_by_vocabulary_is_kept_in_fp32():
    """The plain path keeps an fp32 copy of the logits for its backward; the chunked one keeps the
    logits as they came (bf16) and per-row vectors only."""
    logits, targets, _ = case(torch.bfloat16, rows=64, vocab=1000, pad=24)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(logits.clone().requires_grad_(True) * 1, targets, T, VocabSlice(0, 1000), chunk_rows=16)
    big = [t for t in saved if t.numel() >= 64 * 1000]
    assert big and all(t.dtype == torch.bfloat16 for t in big)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        reference(logits.clone().requires_grad_(True), targets, 1000)
    assert any(t.dtype == torch.float32 and t.numel() >= 64 * 1000 for t in saved)  # what the chunks avoid


def test_the_compiled_kernels_follow_micro_batches_of_changing_length():
    """The backend's call: compiled, the grad overwriting the logits in place. The lengths change, as
    micro-batches' do, so the kernels recompile with the rows symbolic and then keep serving; eager
    is the reference. (A grad kernel taking the logits and an aliasing output failed here on its
    second length with a size assertion.)"""
    for rows in (48, 32, 40, 48):
        logits, targets, weights = case(torch.bfloat16, rows=rows, seed=rows)
        results = []
        for compiled in (False, True):
            leaf = logits.clone().requires_grad_(True)
            got = token_logprobs(
                leaf * 1, targets, T, VocabSlice(0, 300), chunk_rows=16, compiled=compiled, overwrite=True
            )
            (got * weights).sum().backward()
            results.append((got.detach(), leaf.grad.float()))
        (eager, eager_grad), (fused, fused_grad) = results
        torch.testing.assert_close(fused, eager, rtol=0, atol=1e-5)
        torch.testing.assert_close(fused_grad, eager_grad, rtol=0, atol=1e-2)  # bf16 grads: one ulp apart at most
        assert torch.equal(fused_grad[:, 300:], torch.zeros_like(fused_grad[:, 300:]))


def test_bad_chunk_size_is_refused():
    logits, targets, _ = case(torch.float32)
    with pytest.raises(ValueError, match="chunk_rows"):
        token_logprobs(logits, targets, T, VocabSlice(0, 300), chunk_rows=0)
