"""The embedded engine's attention function, registered with transformers under `KILN_ATTENTION`.

HF's sdpa path serves grouped-query attention by `repeat_kv`: every layer of every decode step copies
K and V of the whole static cache once per query head, and with a mask SDPA cannot take
`enable_gqa`. For one query token (decoding) that copy is not needed: the query heads that share a
KV head are laid out as that KV head's query *rows* ([B, H, 1, D] -> [B, H_kv, H / H_kv, D]), so one
SDPA call over the un-repeated cache computes exactly the same softmax(q·k·scale + mask)·v per head,
and a mask shared by all heads ([B, 1, 1, L]) broadcasts unchanged. Everything else (prefill, masks
per head, extra features) goes to HF's own sdpa function untouched.

A decode step reads only the cache positions in use. The decode step (decode_step.py) passes a 4-D mask
over the first L columns of the static cache, L a bucket just past its current column; keys and values
are cut to those L columns here. The columns after L hold nothing any row attends to (not yet written,
or masked off), so softmax over them added exactly zero; reading them was the whole static cache per
layer per step, 8,192 positions where a few hundred were in use.

The name also registers HF's sdpa mask builder, so the model builds the same masks as under "sdpa".
"""

from __future__ import annotations

import logging

import torch

from actors.policy.model import register_attention

log = logging.getLogger(__name__)

KILN_ATTENTION = "kiln_sdpa"


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: query [B, H, q, D], key/value [B, H_kv, L, D]; returns
    ([B, q, H, D], None) like HF's sdpa function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    if q_len == 1 and attention_mask is not None and attention_mask.dim() == 4:
        used = attention_mask.shape[-1]  # the decode step's mask covers the columns in use
        if used < key.shape[-2]:
            key, value = key[:, :, :used], value[:, :, :used]
    kv_heads = key.shape[1]
    plain = (
        q_len != 1
        or kv_heads == heads
        or heads % kv_heads
        or dropout
        or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))
        or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache", "sinks", "s_aux"))
    )
    if plain or _disabled:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    try:
        mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]
        rows = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h uses KV head h // (H / H_kv)
        out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    except RuntimeError as err:  # no SDPA backend took it: HF's path is slower, never wrong
        _disable(err)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


_disabled = False


def _disable(err: Exception) -> None:
    global _disabled
    _disabled = True
    log.warning("grouped-query decode attention failed, decoding with HF's sdpa from now on: %s", err)


def register() -> str:
    """The name to build the engine's model with (`build_model(..., attention=register())`)."""
    return register_attention(KILN_ATTENTION, decode_attention, user="the engine decodes")
