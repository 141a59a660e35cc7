"""The torch engine's batch in a static KV cache (actors/rollout/torch_engine.py decides when; this
module does the tensor work): a row per request, a fresh batch prefilled from left-padded contexts
(`prefill`), and rows inserted into finished rows' slots of a running batch (`insert`).

Every row of a batch shares one cache column per step (what HF's StaticCache supports, and what keeps
the decode step's shapes fixed). A fresh batch left-pads every context so that each row's last
context token sits in the last prefilled column. An inserted row is prefilled alone, into a small
cache of its own, and its keys and values are copied into the batch's cache in the columns just
before the current one, with the slot's mask and position set to match; the other rows are not
touched.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from actors.rollout.decode_step import DecodeStep
from actors.rollout.engine import GenerateRequest


@dataclass
class Row:
    """One request in the engine: what it has generated so far, and its future."""

    req: GenerateRequest
    future: Future
    start: float = field(default_factory=time.monotonic)
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    stops: frozenset[int] = frozenset()


@dataclass
class Batch:
    """The decode state of the rows currently in the static cache."""

    rows: list[Row]
    cache: object  # the static KV cache; None once stale (new weights, or rows to refill)
    step: DecodeStep
    logits: torch.Tensor  # [B, V] logits predicting each row's next token
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    filtered: bool  # some row uses top-p or top-k (known from the requests: no host sync per step)
    sampled: tuple[torch.Tensor, torch.Tensor]  # host buffers the step's tokens and logprobs land in


def _left_padded(contexts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token ids and attention mask of `contexts`, left-padded to the longest; and that width."""
    width = max(len(c) for c in contexts)
    ids = torch.zeros(len(contexts), width, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for i, ctx in enumerate(contexts):
        ids[i, width - len(ctx) :] = torch.tensor(ctx)
        mask[i, width - len(ctx) :] = 1
    return ids.to(device), mask.to(device), width


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache_len: int):
    """One forward over the padded contexts into a fresh static cache of `cache_len` columns; returns
    the cache and each row's last logits (left padding puts every row's last token in the last column)."""
    from transformers import StaticCache

    width = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        cache_position=torch.arange(width, device=ids.device),
        use_cache=True,
        logits_to_keep=1,
    )
    return cache, out.logits[:, -1]


@torch.no_grad()
def prefill(model, rows: list[Row], budget: int, device: torch.device, *, cuda_graphs: bool) -> Batch:
    """A fresh batch of `rows` (their prompts plus what they generated), with `budget` cache columns
    for decoding after the longest context."""
    ids, prompt_mask, width = _left_padded([r.req.prompt_ids + r.out for r in rows], device)
    mask = torch.cat([prompt_mask, torch.zeros(len(rows), budget, dtype=torch.long, device=device)], dim=1)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    cache, logits = _prefill(model, ids, prompt_mask, positions, width + budget)
    params = [r.req.params for r in rows]
    step = DecodeStep(model, cache, mask, positions[:, -1:] + 1, width, cuda_graph=cuda_graphs)
    pinned = device.type == "cuda"  # lets the step's results come to the host without blocking the stream
    return Batch(
        rows=rows,
        cache=cache,
        step=step,
        logits=logits,
        temperature=torch.tensor([p.temperature for p in params], device=device),
        top_p=torch.tensor([p.top_p for p in params], device=device),
        top_k=torch.tensor([p.top_k for p in params], device=device),
        filtered=any(p.top_p < 1 or p.top_k > 0 for p in params),
        sampled=(
            torch.empty(len(rows), dtype=torch.long, pin_memory=pinned),
            torch.empty(len(rows), dtype=torch.float32, pin_memory=pinned),
        ),
    )


@torch.no_grad()
def insert(model, b: Batch, placed: list[tuple[int, Row]], device: torch.device) -> None:
    """Put each (slot, row) of `placed` into the running batch `b`: prefill the rows alone, then copy
    their keys and values into the columns just before the current one. The caller has checked that
    each context fits before the current column and its budget before the cache's end."""
    step, column = b.step, b.step.column
    contexts = [r.req.prompt_ids + r.out for _, r in placed]
    ids, mask, width = _left_padded(contexts, device)
    cache, logits = _prefill(model, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), width)
    for j, ((slot, row), ctx) in enumerate(zip(placed, contexts, strict=True)):
        n = len(ctx)
        # Keys carry their rotary position already: any columns before the current one will do,
        # as long as the slot's mask shows exactly them (and every column decoded from here on).
        for src, dst in zip(cache.layers, b.cache.layers, strict=True):
            dst.keys[slot, :, column - n : column] = src.keys[j, :, width - n :]
            dst.values[slot, :, column - n : column] = src.values[j, :, width - n :]
        step.mask[slot] = False
        step.mask[slot, 0, 0, column - n : column] = True
        step.positions[slot] = n
        b.logits[slot] = logits[j]
        p = row.req.params
        b.temperature[slot], b.top_p[slot], b.top_k[slot] = p.temperature, p.top_p, p.top_k
        b.rows[slot] = row
    b.filtered = any(r.req.params.top_p < 1 or r.req.params.top_k > 0 for r in b.rows if r.finish is None)
