"""The embedded engine's attention function, registered with transformers under `KILN_ATTENTION`.

HF's sdpa path serves grouped-query attention by `repeat_kv`: every layer of every decode step copies
K and V of the whole static cache once per query head, and with a mask SDPA cannot take
`enable_gqa`. For one query token (decoding) that copy is not needed: the query heads that share a
KV head are laid out as that KV head's query *rows* ([B, H, 1, D] -> [B, H_kv, H / H_kv, D]), so one
SDPA call over the un-repeated cache computes exactly the same softmax(q·k·scale + mask)·v per head,
and a mask shared by all heads ([B, 1, 1, L]) broadcasts unchanged. Everything else (prefill, masks
per head, extra features) goes to HF's own sdpa function untouched.

A decode step reads only the cache positions in use. On CUDA the decode step passes each slot's column
(`DECODE_COLUMNS`) and attention is decode_kernel.py's Triton kernel, which reads every slot's keys
and values up to its own column and no further. Elsewhere (CPU, or no triton), the decode step (decode_step.py) passes a 4-D mask
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
from actors.rollout import decode_kernel

log = logging.getLogger(__name__)

KILN_ATTENTION = "kiln_sdpa"
# The keyword the decode step passes through the model to this function: each slot's column [B]
# (int64; the slot attends to columns [0, column]). With it, on CUDA, decoding takes the kernel of
# decode_kernel.py, which reads each slot's own columns only.
DECODE_COLUMNS = "kiln_decode_columns"


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
    columns = kwargs.pop(DECODE_COLUMNS, None)
    if columns is not None and q_len == 1 and query.is_cuda and not _kernel_disabled:
        try:
            return decode_kernel.decode_attention(query, key, value, columns, scaling or dim**-0.5), None
        except (RuntimeError, ValueError, ImportError) as err:  # the masked path below is slower, never wrong
            _disable_kernel(err)
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
_kernel_disabled = False


def _disable_kernel(err: Exception) -> None:
    global _kernel_disabled
    _kernel_disabled = True
    log.warning("the decode attention kernel failed, decoding with masked SDPA from now on: %s", err)


def _disable(err: Exception) -> None:
    global _disabled
    _disabled = True
    log.warning("grouped-query decode attention failed, decoding with HF's sdpa from now on: %s", err)


def register() -> str:
    """The name to build the engine's model with (`build_model(..., attention=register())`)."""
    return register_attention(KILN_ATTENTION, decode_attention, user="the engine decodes")
