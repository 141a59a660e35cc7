"""The engine's decode attention on CUDA: a Triton kernel that reads, for each slot, only the cache
columns that slot holds (flash-decoding: split over the keys, then one merge).

Why a kernel of its own: a decode step has one query token per slot and slots of very different
lengths in one cache. SDPA with a mask reads every column up to the mask's width for every slot (the
longest slot decides it), and on sm90 it dispatched a prefill-shaped cuDNN kernel that took 290 µs per
layer for 64 slots of ~1.8k columns in an 8,192-column cache (docs/BENCHMARKS.md). Here each slot's
keys and values are read once, up to its own column; the query heads that share a KV head are one
block of rows against that KV head (grouped-query attention without repeating the cache).

Layout: query [B, H, 1, D], keys and values [B, H_kv, N, D] (the engine's slot cache), `columns` [B]
int64: slot b attends to its columns [0, columns[b]] (inclusive: the column its new token was just
written to). Each (slot, KV head) is split into SPLITS ranges of keys; each program keeps a running
max, sum and weighted value sum over its range (the online softmax), and the merge kernel combines the
ranges exactly (flash-decoding). The grid is fixed by the cache's shape, not by the slots' lengths, so
one CUDA graph serves every step whatever the lengths: a split past a slot's column does no work.

Only this module imports triton (a GPU library: absent where there is no CUDA, e.g. CI).
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK_N = 64  # keys per inner iteration
MIN_ROWS = 16  # tl.dot's smallest M: the query heads of one KV head are padded up to it


@functools.cache
def available() -> bool:
    """Whether the kernel can run here: triton importable and a CUDA device present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def splits_for(cache_len: int) -> int:
    """Key ranges per (slot, KV head): about one per 1,024 cache columns, a power of two from 1 to 16, so
    a few long slots still spread over the GPU's SMs while a full batch of short ones costs nothing
    extra (a range past a slot's column returns at once)."""
    n = 1
    while n < 16 and 2 * n * 1024 <= cache_len:
        n *= 2
    return n


@torch.library.custom_op("kiln::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v of each slot's query heads over its columns [0, columns[b]];
    returns [B, 1, H, D] in the query's dtype (transformers' attention output layout). An operator of
    its own, so a compiled model calls it as one opaque op."""
    return _kernels().run(query, key, value, columns, scale)


@decode_attention.register_fake
def _(query, key, value, columns, scale):
    batch, heads, _, dim = query.shape
    return query.new_empty(batch, 1, heads, dim)


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same attention in plain torch (masked SDPA over the whole cache, KV heads repeated): what
    the kernel is tested against."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    span = torch.arange(key.shape[2], device=key.device)
    mask = (span[None, :] <= columns[:, None])[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(
        Q, K, V, Cols, Acc, Max, Sum,
        sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
        N, scale_log2,
        HEADS: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
        SPLITS: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        n = tl.minimum(tl.load(Cols + b).to(tl.int32) + 1, N)  # keys [0, n); never past the cache
        per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK) * BLOCK
        start = split * per
        end = tl.minimum(start + per, n)
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, DIM)
        head = kvh * GROUPS + rows
        q = tl.load(Q + b * sq_b + head[:, None] * sq_h + dims[None, :], mask=rows[:, None] < GROUPS, other=0.0)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        s = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM], tl.float32)
        k_base = K + b * sk_b + kvh * sk_h
        v_base = V + b * sv_b + kvh * sv_h
        for lo in tl.range(start, end, BLOCK):
            keys = lo + tl.arange(0, BLOCK)
            inside = keys < end
            k = tl.load(k_base + keys[:, None] * sk_n + dims[None, :], mask=inside[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [ROWS, BLOCK], in log2 units
            qk = tl.where(inside[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            s = s * alpha + tl.sum(p, 1)
            v = tl.load(v_base + keys[:, None] * sv_n + dims[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        keep = rows < GROUPS
        at = (b * HEADS + head) * SPLITS + split
        tl.store(Max + at, m, mask=keep)
        tl.store(Sum + at, s, mask=keep)
        tl.store(Acc + at[:, None] * DIM + dims[None, :], acc, mask=keep[:, None])

    @triton.jit
    def merge_kernel(Acc, Max, Sum, Out, HEADS: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr):
        bh = tl.program_id(0)  # slot * HEADS + head; Out is [B, 1, H, D], the same order
        parts = tl.arange(0, SPLITS)
        dims = tl.arange(0, DIM)
        m = tl.load(Max + bh * SPLITS + parts)
        s = tl.load(Sum + bh * SPLITS + parts)
        top = tl.max(m, 0)  # finite: split 0 always holds column 0
        w = tl.exp2(m - top)  # an empty split (m = -inf) weighs 0
        acc = tl.load(Acc + (bh * SPLITS + parts)[:, None] * DIM + dims[None, :])
        out = tl.sum(acc * w[:, None], 0) / tl.sum(s * w, 0)
        tl.store(Out + bh * DIM + dims, out.to(Out.dtype.element_ty))

    class Kernels:
        @staticmethod
        def run(query, key, value, columns, scale):
            batch, heads, q_len, dim = query.shape
            kv_heads, cache_len = key.shape[1], key.shape[2]
            if q_len != 1 or heads % kv_heads or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
                raise ValueError(
                    f"decode attention takes one query token and unit-stride heads, got {tuple(query.shape)}"
                )
            if dim & (dim - 1) or dim < 16:
                raise ValueError(f"decode attention needs a power-of-two head size >= 16, got {dim}")
            groups = heads // kv_heads
            splits = splits_for(cache_len)
            rows = max(MIN_ROWS, triton.next_power_of_2(groups))
            acc = torch.empty(batch * heads * splits, dim, dtype=torch.float32, device=query.device)
            mx = torch.empty(batch * heads * splits, dtype=torch.float32, device=query.device)
            sm = torch.empty_like(mx)
            partial_kernel[(batch, kv_heads, splits)](
                query, key, value, columns, acc, mx, sm,
                query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
                value.stride(0), value.stride(1), value.stride(2),
                cache_len, scale * math.log2(math.e),
                HEADS=heads, GROUPS=groups, ROWS=rows, DIM=dim, SPLITS=splits, BLOCK=BLOCK_N,
                PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # fp32: no tf32 rounding
            )  # fmt: skip
            out = torch.empty(batch, 1, heads, dim, dtype=query.dtype, device=query.device)
            merge_kernel[(batch * heads,)](acc, mx, sm, out, HEADS=heads, DIM=dim, SPLITS=splits)
            return out

    return Kernels
