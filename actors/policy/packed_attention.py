"""Attention over a packed row of whole sequences at the cost of each sequence's own length squared,
registered with transformers under `PACKED_ATTENTION` (the learner's model; actors/learner/batch.py
packs a micro-batch of whole sequences into one row whose position ids restart per sequence).

Under transformers' "sdpa" such a row gets a dense T x T block-diagonal mask, built per forward and
applied by SDPA's masked kernel: time and memory grow with T², 8,192² per layer and head for a full
micro-batch, where only the Σ L_i² entries inside the sequences are ever attended. On the 2-core CPU
machine that was 9.7 s per learner step of a 2-layer, 64-wide model (15k tokens), almost all of it
in the mask and the attention.

Here no mask is built: the row's queries, keys and values are laid out as a right-padded batch
[S, H, longest, D] (one entry per sequence) and attended with SDPA's causal kernel. A real token
attends to exactly its own sequence's earlier tokens, as under the block mask: right padding sits
after every real token, so causality keeps it out, and the padded positions' outputs are dropped when
the row is put back together. Gradients flow through the gather and the scatter. Sequences start
where the position ids do not step by one (transformers' own packing rule); the layout is worked out
once per forward (every layer sees the same position ids) and a row without restarts is one sequence.

Anything else is handed to HF's sdpa function: a call with a mask (padding, a KV cache), with more
queries than keys or fewer, or without position ids, unchanged (the mask builder builds what "sdpa"
builds for those); rows of whole sequences with a feature this path does not take (soft-capping,
sinks, a sliding window), with the block mask "sdpa" would have built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.policy.model import register_attention

PACKED_ATTENTION = "kiln_packed"

# Keyword arguments that ask for more than causal attention within each sequence.
_FEATURES = ("sliding_window", "softcap", "position_bias", "sinks", "s_aux")


@dataclass(frozen=True)
class Packing:
    """Where a packed batch's tokens sit in the padded per-sequence layout. `gather[s * longest + i]` is
    the row-major token index of sequence s's token i (padding points at token 0, its output dropped);
    `scatter[t]` is token t's index in that layout."""

    sequences: int
    longest: int
    gather: torch.Tensor  # int64 [sequences * longest]
    scatter: torch.Tensor  # int64 [B * T]
    sequence_of: torch.Tensor  # int64 [B * T]: each token's sequence

    def block_mask(self, batch: int, width: int) -> torch.Tensor:
        """The dense [B, 1, T, T] mask "sdpa" builds for the rows: True where a token attends."""
        seq = self.sequence_of.view(batch, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=seq.device).tril()
        return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> Packing:
        """The packing of rows [B, T] of position ids: a sequence starts at each row's first token and
        wherever a position does not follow the one before it by exactly one."""
        rows, width = position_ids.shape
        starts = torch.ones(rows, width, dtype=torch.bool, device=position_ids.device)
        starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
        first = starts.reshape(-1).nonzero().squeeze(1).cpu()  # one host sync per forward
        total = rows * width
        lengths = torch.diff(first, append=torch.tensor([total]))
        sequences, longest = len(first), int(lengths.max())
        offset = torch.arange(longest)
        valid = offset[None, :] < lengths[:, None]
        gather = torch.where(valid, first[:, None] + offset[None, :], 0).reshape(-1)
        seq_of_token = torch.repeat_interleave(torch.arange(sequences), lengths)
        scatter = seq_of_token * longest + (torch.arange(total) - first[seq_of_token])
        device = position_ids.device
        return cls(sequences, longest, gather.to(device), scatter.to(device), seq_of_token.to(device))


# The position ids seen last, their version counter (bumped by any in-place change) and their packing.
_last: tuple[torch.Tensor, int, Packing] | None = None


def _packing(position_ids: torch.Tensor) -> Packing:
    """The packing of `position_ids`, worked out once for the forward's many layers: transformers passes
    every layer the same tensor object."""
    global _last
    last = _last  # one read: another thread's model may replace it meanwhile
    if last is not None and last[0] is position_ids and last[1] == position_ids._version:
        return last[2]
    packing = Packing.of(position_ids)
    _last = (position_ids, position_ids._version, packing)
    return packing


def _sequences(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """[B, H, T, D] -> [S, H, longest, D]: each sequence's tokens from the packed rows, right-padded."""
    batch, heads, width, dim = x.shape
    flat = x.transpose(1, 2).reshape(batch * width, heads, dim)
    return flat[packing.gather].view(packing.sequences, packing.longest, heads, dim).transpose(1, 2)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: query [B, H, T, D], key/value [B, H_kv, T, D]; returns
    ([B, T, H, D], None) like HF's sdpa function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    batch, heads, width, _ = query.shape
    rows = (
        attention_mask is None
        and position_ids is not None
        and tuple(position_ids.shape) == (batch, width)
        and key.shape[-2] == width
        and getattr(module, "is_causal", True)
    )
    if rows:
        packing = _packing(position_ids)
        if heads % key.shape[1] == 0 and not any(kwargs.get(k) is not None for k in _FEATURES):
            return _attend(query, key, value, packing, dropout, scaling), None
        attention_mask = packing.block_mask(batch, width)  # exact and as slow as "sdpa"'s
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _attend(query, key, value, packing: Packing, dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal attention within each sequence of the packed rows: [B, T, H, D] like HF's sdpa function."""
    batch, heads, width, dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        _sequences(query, packing),
        _sequences(key, packing),
        _sequences(value, packing),
        dropout_p=dropout,
        is_causal=True,
        scale=scaling,
        enable_gqa=key.shape[1] != heads,
    )  # [S, H, longest, D]
    flat = out.transpose(1, 2).reshape(packing.sequences * packing.longest, heads, dim)
    return flat[packing.scatter].view(batch, width, heads, dim)


def packed_mask(**kwargs):
    """The mask builder: no mask for rows of whole sequences (no padding mask, as many queries as keys,
    no sliding window), which `packed_attention` lays out itself; otherwise the mask "sdpa" builds."""
    from transformers.masking_utils import sdpa_mask

    config = kwargs.get("config")
    whole = (
        kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get("q_offset") and not kwargs.get("kv_offset")
    )
    if kwargs.get("attention_mask") is None and whole and config is not None and not _windowed(config):
        return None
    return sdpa_mask(**kwargs)


def _windowed(config) -> bool:
    """Whether a model's layers may use a sliding window or another mask this path cannot lay out."""
    return any(getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size")) and bool(
        getattr(config, "use_sliding_window", True)
    )


def register() -> str:
    """The name to build the learner's model with (`build_model(..., attention=register())`)."""
    return register_attention(PACKED_ATTENTION, packed_attention, packed_mask, user="the learner attends")
