"""Core attention for megatron-core's local (Transformer-Engine-free) GPT layer: RoPE + torch SDPA.

megatron-core's local `DotProductAttention` materialises the [b, heads, s, s] score matrix with an
explicit mask and refuses packed (THD) sequences, and its THD RoPE path syncs the host twice per
layer (`cu_seqlens.tolist()`), which left the GPU idle. Kiln trains on packed micro-batches of whole
sequences, so the model is built with `position_embedding_type="none"` and this module does both:
it rotates q and k with cos/sin tables computed once per micro-batch from per-token positions that
restart at each sequence (`RotaryTables`, HF's default RoPE exactly), then runs one causal
`scaled_dot_product_attention` per sequence (flash / cuDNN kernels, no mask tensor, no
cross-sequence attention). KV heads are repeated to the query heads of this rank (GQA) so every
fused SDPA backend applies. `SelfAttention` has already applied Qwen3's q/k norm (HF's order too).
With `fused_rope` the rotation of q and of k runs as one torch.compile'd kernel each (forward and
backward) instead of eager cat / mul / add.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule


class RotaryTables:
    """HF's default RoPE (rotate-half, not interleaved): inv_freq = 1 / θ^(2i/d) in float32."""

    def __init__(self, theta: float, head_dim: int):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin [t, 1, head_dim] for int positions [t]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [t, heads, d] rotated by cos/sin [t, 1, d] (computed in float32, applied in x's dtype, as HF)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@functools.cache
def _compiled_rotary():
    # torch.compile's default dynamic shapes: a recompile makes only the dims that changed symbolic (the
    # rows, and the heads between q and k), so head_dim and its halves stay constants. With every dim
    # symbolic (`dynamic=True`) the kernel ran at 2x the time on an H200 (launch.bench.learner_kernels).
    return torch.compile(apply_rotary)


@dataclass
class PackedSequences(PackedSeqParams):
    """megatron's THD parameters plus what `SDPAAttention` needs without touching the device: the
    sequence boundaries on the host and the RoPE tables of this micro-batch."""

    boundaries: tuple[int, ...] = ()
    rope_cos: torch.Tensor | None = None  # float32 [t, 1, head_dim]
    rope_sin: torch.Tensor | None = None
    fused_rope: bool = False  # rotate with the compiled kernel

    @classmethod
    def build(
        cls, boundaries: list[int], positions: torch.Tensor, rope: RotaryTables, *, fused_rope: bool = False
    ) -> PackedSequences:
        """`boundaries`: rising token offsets [0, ..., t] of the non-empty sequences; `positions`:
        each token's position in its sequence [t]."""
        cu = torch.tensor(boundaries, dtype=torch.int32, device=positions.device)
        longest = max((b - a for a, b in itertools.pairwise(boundaries)), default=0)
        cos, sin = rope.cos_sin(positions)
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            boundaries=tuple(boundaries),
            rope_cos=cos,
            rope_sin=sin,
            fused_rope=fused_rope,
        )


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q [b, hq, s, d], k/v [b, hkv, s, d] -> [b, hq, s, d], causal."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class SDPAAttention(MegatronModule):
    """Drop-in `core_attention` for megatron's `SelfAttention` (same constructor and forward)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAAttention does not support context parallelism")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0.0:
            raise ValueError("SDPAAttention runs without attention dropout (set attention_dropout=0)")
        self.softmax_scale = softmax_scale  # None: SDPA's 1/sqrt(head_dim), megatron's default too

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
    ):
        """query [t, heads, d], key/value [t, kv_heads, d] (THD) -> [t, heads * d]."""
        if attention_bias is not None:
            raise ValueError("SDPAAttention does not take an attention bias")
        if not isinstance(packed_seq_params, PackedSequences) or packed_seq_params.rope_cos is None:
            raise ValueError("SDPAAttention needs PackedSequences with RoPE tables (use model.packed_forward)")
        cos, sin = packed_seq_params.rope_cos, packed_seq_params.rope_sin
        rotate = _compiled_rotary() if packed_seq_params.fused_rope else apply_rotary
        query, key = rotate(query, cos, sin), rotate(key, cos, sin)
        bounds = packed_seq_params.boundaries
        outputs = []
        for start, stop in itertools.pairwise(bounds):
            if stop == start:
                continue
            q, k, v = (t[start:stop].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            outputs.append(_causal_sdpa(q, k, v, self.softmax_scale)[0].transpose(0, 1))
        out = torch.cat(outputs, dim=0) if len(outputs) > 1 else outputs[0]
        return out.reshape(out.shape[0], -1)
