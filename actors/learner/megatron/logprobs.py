"""Token logprobs and entropies from vocab-parallel logits, in row chunks: never fp32 logits over the
whole vocabulary.

The output layer gives each TP rank its slice of the logits, [t, V/tp] in the model's dtype. The
plain way to a logprob (`logits.float() / T`, then megatron's vocab-parallel cross entropy) makes an
fp32 copy of all of them, another for the division, and keeps the fp32 softmax for the backward: for
8,192 tokens and a 151,936-token vocabulary that is 5 GB per copy, written and read ~10 times.

`token_logprobs` walks the rows in chunks instead. Per chunk, z = logits / T in fp32 exists for that
chunk only; each rank reduces its slice to the row max m, s = Σ e^(z - m) and the target's z (on the
rank whose slice holds the target); across the TP group M = max m, S = Σ s·e^(m - M), and
log p(target) = z_target - M - log S. The forward keeps the logits and the log-normaliser
lse = M + log S [t]; the backward recomputes each chunk's softmax from them,
  ∂ log p / ∂ logits = (onehot(target) - softmax(z)) / T,
and, with `overwrite=True` (the backend: nothing else reads the logits after this backward), writes
the gradient into the logits' own storage, so the backward allocates nothing of size t × V. `token_entropy` (a metric, no gradient) reduces the same way:
per rank also w = Σ e^(z - m)·(z - m); H = log S - W / S with W = Σ e^(m - M)·(w + s·(m - M)).
Columns past the real vocabulary (the padding of the last rank's slice) are left out throughout.

`compiled=True` runs the per-chunk work as torch.compile'd kernels (each pass one read of the chunk,
no fp32 temporaries); otherwise as eager torch ops (CPU, and the reference for the compiled kernels).
Pure torch and torch.distributed: no megatron import, so it is tested on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabSlice:
    """This TP rank's columns of the logits: vocabulary ids [start, start + valid) are real, any
    columns after them padding; `group` is the TP group (None: one rank, nothing to reduce)."""

    start: int
    valid: int
    group: object = None

    @property
    def reduces(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1


# ------------------------------------------------------------------------------ per-chunk kernels


def chunk_stats(x: torch.Tensor, inv_t: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One chunk's (row max m, Σ e^(z - m), z of the target or 0 where this slice lacks it); z = x / T."""
    z = x.float() * inv_t
    m = z.amax(dim=-1)
    s = torch.exp(z - m[:, None]).sum(dim=-1)
    here = (target >= 0) & (target < x.shape[-1])
    zt = torch.where(here, z.gather(1, target.clamp(0, x.shape[-1] - 1)[:, None])[:, 0], torch.zeros_like(m))
    return m, s, zt


def chunk_grad(
    x: torch.Tensor, inv_t: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """One chunk's ∂ loss / ∂ logits = g · (onehot(target) - softmax(z)) / T, in x's dtype."""
    p = torch.exp(x.float() * inv_t - lse[:, None])
    cols = torch.arange(x.shape[-1], device=x.device)
    onehot = (cols[None, :] == target[:, None]).float()
    return ((onehot - p) * (g * inv_t)[:, None]).to(x.dtype)


def chunk_grad_(x: torch.Tensor, inv_t: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, g: torch.Tensor) -> None:
    """`chunk_grad` written over x itself. Compiled, the write is part of the kernel: one read and one
    write of the chunk, where a copy after the kernel reads and writes it again. (x is the only tensor
    written: a second argument aliasing it makes torch.compile rebuild their common base, whose size it
    does not guard, and the next micro-batch of another length fails its size assertion.)"""
    x.copy_(chunk_grad(x, inv_t, target, lse, g))


def chunk_entropy_stats(x: torch.Tensor, inv_t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One chunk's (row max m, Σ e^(z - m), Σ e^(z - m)·(z - m))."""
    z = x.float() * inv_t
    m = z.amax(dim=-1)
    d = z - m[:, None]
    e = torch.exp(d)
    return m, e.sum(dim=-1), (e * d).sum(dim=-1)


def _empty_stats(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, third) of a slice without real columns (all padding): it adds nothing to the sums."""
    zeros = torch.zeros(rows, dtype=torch.float32, device=device)
    return torch.full_like(zeros, float("-inf")), zeros, zeros.clone()


@functools.cache
def _kernels(compiled: bool):
    kernels = (chunk_stats, chunk_grad_, chunk_entropy_stats)
    if not compiled:
        return kernels
    # torch.compile's default ("automatic") dynamic shapes: the first shape compiles static, and a
    # recompile makes only the dim that changed symbolic (here the rows: the last chunk is shorter),
    # so the vocabulary width stays a constant. With every dim symbolic (`dynamic=True`) the grad kernel
    # took 2.2x the time it takes this way on an H200 (launch.bench.learner_kernels; docs/BENCHMARKS.md).
    return tuple(torch.compile(fn) for fn in kernels)


# ------------------------------------------------------------------------------ across the TP group


def _combine(m: torch.Tensor, s: torch.Tensor, vocab: VocabSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """The global row max M and Σ over ranks of s·e^(m - M) (each rank's s is relative to its own m)."""
    if not vocab.reduces:
        return m, s
    top = m.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=vocab.group)
    s = s * torch.exp(m - top)
    dist.all_reduce(s, group=vocab.group)
    return top, s


def _sum(t: torch.Tensor, vocab: VocabSlice) -> torch.Tensor:
    if vocab.reduces:
        dist.all_reduce(t, group=vocab.group)
    return t


# ------------------------------------------------------------------------------ logprobs


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        vocab: VocabSlice,
        chunk_rows: int,
        compiled: bool,
        overwrite: bool,
    ) -> torch.Tensor:
        stats, _, _ = _kernels(compiled)
        real = logits[:, : vocab.valid]
        inv_t = torch.tensor(1.0 / temperature, dtype=torch.float32, device=logits.device)
        local_targets = targets - vocab.start  # outside [0, valid) on the ranks that lack the target
        local_targets = torch.where(local_targets < vocab.valid, local_targets, torch.full_like(local_targets, -1))
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        for row in range(0, n, chunk_rows):
            rows = slice(row, row + chunk_rows)
            if vocab.valid > 0:
                m, s, zt = stats(real[rows], inv_t, local_targets[rows])
            else:
                m, s, zt = _empty_stats(real[rows].shape[0], logits.device)
            top, total = _combine(m, s, vocab)
            lse[rows] = top + torch.log(total)
            out[rows] = _sum(zt, vocab) - lse[rows]
        ctx.save_for_backward(logits, local_targets, lse, inv_t)
        ctx.vocab, ctx.chunk_rows, ctx.compiled, ctx.overwrite = vocab, chunk_rows, compiled, overwrite
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, local_targets, lse, inv_t = ctx.saved_tensors
        _, grad, _ = _kernels(ctx.compiled)
        valid, chunk_rows = ctx.vocab.valid, ctx.chunk_rows
        grad_out = grad_out.float()
        out = logits if ctx.overwrite else logits.clone()  # the grad overwrites each chunk of its input
        for row in range(0, logits.shape[0], chunk_rows) if valid > 0 else ():
            rows = slice(row, row + chunk_rows)
            grad(out[rows, :valid], inv_t, local_targets[rows], lse[rows], grad_out[rows])
        if valid < logits.shape[1]:
            out[:, valid:] = 0
        return out, None, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab: VocabSlice,
    *,
    chunk_rows: int = 2048,
    compiled: bool = False,
    overwrite: bool = False,
) -> torch.Tensor:
    """float32 log softmax(logits / T)[target] over the whole vocabulary, from this rank's slice of the
    logits [t, V/tp] (targets are whole-vocabulary ids [t]); differentiable. Every TP rank must call
    it with the same t (all-reduces per chunk). `overwrite`: the backward writes the gradient into the
    logits' storage (only when nothing else uses these logits afterwards)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return _ChunkedLogprobs.apply(logits, targets, temperature, vocab, chunk_rows, compiled, overwrite)


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor, temperature: float, vocab: VocabSlice, *, chunk_rows: int = 2048, compiled: bool = False
) -> torch.Tensor:
    """float32 entropy of softmax(logits / T) over the whole vocabulary [t], from this rank's slice (a
    metric: no gradient). Every TP rank must call it with the same t."""
    _, _, stats = _kernels(compiled)
    real = logits[:, : vocab.valid]
    inv_t = torch.tensor(1.0 / temperature, dtype=torch.float32, device=logits.device)
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for row in range(0, logits.shape[0], chunk_rows):
        rows = slice(row, row + chunk_rows)
        m, s, w = stats(real[rows], inv_t) if vocab.valid > 0 else _empty_stats(real[rows].shape[0], logits.device)
        top, total = _combine(m, s, vocab)
        term = torch.exp(m - top) * (w + s * (m - top))
        weighted = _sum(torch.where(s > 0, term, torch.zeros_like(term)), vocab)  # a padding-only slice: 0, not 0·∞
        out[rows] = torch.log(total) - weighted / total
    return out
