"""The torch engine's batch in a persistent KV cache (actors/rollout/torch_engine.py decides when; this
module does the tensor work): `max_batch` slots, each a row of one cache of `cache_len` columns per
layer, allocated once for the engine's life (`allocate`); requests are prefilled together, packed
into one row without padding, into free slots at any time (`fill`), and a slot is parked when its
row finishes (`park`). The running rows are never touched by either.

Each slot keeps its own length: a row's context sits in its slot's columns [0, n), its next token goes
to column n (its position id), and its mask row shows exactly the columns it wrote. So a request is
admitted whatever the others' lengths are, and no admission re-prefills anyone: the batch is rebuilt
(every live row prefilled again into its own slot) only when new weights land. Per-row columns are
what HF's StaticCache cannot do (one column for the whole batch), hence `SlotLayer`: a cache layer
that writes each row's new keys and values at that row's column, in place, on buffers whose addresses
never change, so the decode step's CUDA graphs stay valid across admissions.

A parked slot holds column 0 alone in its mask: it keeps decoding (the batch's shapes are fixed) on one
valid key, so its logits stay finite for the batch's sampling and are never read.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from actors.policy import packed_attention
from actors.policy.model import cache_keyword
from actors.rollout.decode_step import MIN_ATTENDED, DecodeStep
from actors.rollout.engine import GenerateRequest
from actors.rollout.prefix_cache import PrefixCache


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

    @property
    def context(self) -> list[int]:
        return self.req.prompt_ids + self.out


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values, [max_batch, kv_heads, cache_len, head_dim], written one token per
    row at the row's own column (`columns`, shared with the decode step)."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.columns = keys, values, columns
        self.slot_ids = torch.arange(keys.shape[0], device=keys.device)
        self.device, self.is_initialized = keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # allocated up front (`allocate`)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, tokens = key_states.shape[0], key_states.shape[2]
        if tokens != 1 or rows != self.keys.shape[0]:
            raise ValueError(
                f"a slot cache takes one token for each of its {self.keys.shape[0]} rows, got {rows}x{tokens}"
            )
        # keys[b, :, columns[b]] = key_states[b, :, 0]: an in-place index_put, which a compiled step
        # keeps in place (a scatter_ there became a copy of the whole layer's cache per step).
        self.keys[self.slot_ids, :, self.columns] = key_states[:, :, 0]
        self.values[self.slot_ids, :, self.columns] = value_states[:, :, 0]
        return self.keys, self.values

    def head(self, rows: int) -> SlotLayer:
        """This layer over its first `rows` slots: views of the same buffers (an eager step's batch)."""
        return SlotLayer(self.keys[:rows], self.values[:rows], self.columns[:rows])

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0  # rows differ; the decode step passes position ids and a 4-D mask, so nobody asks

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_max_cache_shape(self) -> int:  # the name transformers releases before 5 ask for
        return self.keys.shape[2]


@dataclass
class Slots:
    """The decode state of the engine's `max_batch` slots."""

    rows: list[Row | None]  # the request in each slot; None: parked
    layers: list[SlotLayer]
    step: DecodeStep
    logits: torch.Tensor  # [B, V] logits predicting each slot's next token
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    sampled: tuple[torch.Tensor, torch.Tensor]  # host buffers the step's tokens and logprobs land in
    columns: list[int]  # the host's copy of each slot's next column (the step's `columns`)
    filtered: bool = False  # some live row uses top-p or top-k (known from the requests: no host sync)

    @property
    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is not None]

    @property
    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is None]

    def highest(self) -> int:
        """One past the highest live slot: an eager decode step need not go past it (slots fill lowest first)."""
        return max(self.live, default=-1) + 1

    def longest(self) -> int:
        """Columns the next decode step must read: one past the largest column it writes."""
        return max((self.columns[i] for i in self.live), default=0) + 1


def allocate(
    model,
    max_batch: int,
    cache_len: int,
    device: torch.device,
    *,
    cuda_graphs: bool,
    min_attended: int = MIN_ATTENDED,
    compiled: bool = True,
) -> Slots:
    """`max_batch` parked slots over a cache of `cache_len` columns per layer, in the model's dtype
    (`min_attended`, `compiled`: the decode step's smallest bucket, and whether it may be compiled)."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    columns = torch.zeros(max_batch, dtype=torch.long, device=device)
    layers = [
        SlotLayer(
            torch.zeros(max_batch, heads, cache_len, dim, dtype=dtype, device=device),
            torch.zeros(max_batch, heads, cache_len, dim, dtype=dtype, device=device),
            columns,
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    mask = torch.zeros(max_batch, 1, 1, cache_len, dtype=torch.bool, device=device)
    mask[..., 0] = True  # every slot parked
    step = DecodeStep(
        model, Cache(layers=layers), mask, columns, cuda_graph=cuda_graphs, min_attended=min_attended, compiled=compiled
    )
    pinned = device.type == "cuda"  # lets the step's results come to the host without blocking the stream
    step.logits = torch.zeros(max_batch, cfg.vocab_size, dtype=torch.float32, device=device)  # eager steps write here
    return Slots(
        rows=[None] * max_batch,
        layers=layers,
        step=step,
        logits=step.logits,
        temperature=torch.ones(max_batch, device=device),
        top_p=torch.ones(max_batch, device=device),
        top_k=torch.zeros(max_batch, dtype=torch.long, device=device),
        sampled=(
            torch.empty(max_batch, dtype=torch.long, pin_memory=pinned),
            torch.empty(max_batch, dtype=torch.float32, pin_memory=pinned),
        ),
        columns=[0] * max_batch,
    )


def _packed(contexts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [1, total] of `contexts` back to back, and their position ids, restarting at 0 for each
    context: the packed row the learner's attention (actors/policy/packed_attention.py) attends
    within each context only."""
    ids = torch.tensor([t for c in contexts for t in c], dtype=torch.long)
    positions = torch.cat([torch.arange(len(c)) for c in contexts])
    return ids[None].to(device), positions[None].to(device)


@contextlib.contextmanager
def _attending_packed(model):
    """The model's attention switched to the packed one for this block (the prefill's forward), then back
    to the engine's (the decode step's compiled code and graphs were made with it)."""
    config = model.config
    engine_attention = config._attn_implementation
    config._attn_implementation = packed_attention.register()
    try:
        yield
    finally:
        config._attn_implementation = engine_attention


@torch.no_grad()
def fill(
    model, s: Slots, placed: list[tuple[int, Row]], device: torch.device, prefix: PrefixCache | None = None
) -> tuple[int, int]:
    """Put each (slot, row) of `placed` into its slot, its keys and values in the slot's columns [0, n)
    and its first logits, mask, position and sampling settings set. Returns (context tokens computed,
    context tokens placed).

    A row whose context shares a prefix with one the `prefix` cache holds gets that prefix's keys and
    values copied and only the rest computed (`_extend`). The other rows' distinct contexts are
    prefilled together as one packed row, each attending within itself (`_prefill_packed`): rows with
    the same context (a group's G attempts of one prompt, admitted together) share one prefill, and
    each of their slots gets copies of the same keys, values and logits, which is what G prefills would
    have computed. Every context computed here goes into the cache, for the rows that extend it later.
    The caller has checked that each context leaves room for a token."""
    reused, fresh = [], []
    for at, (slot, row) in enumerate(placed):
        hit = prefix.match(row.context) if prefix is not None else None
        if hit is None:
            fresh.append((at, slot, row))
        else:
            reused.append((at, slot, row, hit))
    logits: list[torch.Tensor | None] = [None] * len(placed)
    computed = _prefill_packed(model, s, fresh, device, prefix, logits) if fresh else 0
    for at, slot, row, (entry, shared) in reused:
        computed += _extend(model, s, slot, row, entry, shared, device, prefix, logits, at)
    lengths = [len(row.context) for _, row in placed]
    slots = torch.tensor([slot for slot, _ in placed], device=device)
    n = torch.tensor(lengths, device=device)
    step = s.step
    step.mask[slots] = (torch.arange(step.cache_len, device=device)[None, :] < n[:, None])[:, None, None, :]
    step.columns[slots] = n
    step.live[slots] = 1
    s.logits[slots] = torch.stack(logits).to(s.logits.dtype)  # the decode step's dtype once it has run
    params = [row.req.params for _, row in placed]
    s.temperature[slots] = torch.tensor([p.temperature for p in params], device=device, dtype=s.temperature.dtype)
    s.top_p[slots] = torch.tensor([p.top_p for p in params], device=device, dtype=s.top_p.dtype)
    s.top_k[slots] = torch.tensor([p.top_k for p in params], device=device, dtype=s.top_k.dtype)
    for (slot, row), k in zip(placed, lengths, strict=True):
        s.rows[slot], s.columns[slot] = row, k
    _refilter(s)
    return computed, sum(lengths)


def _prefill_packed(model, s: Slots, rows: list, device: torch.device, prefix, logits: list) -> int:
    """Prefill the distinct contexts of `rows` ((index in the fill, slot, row)) in one packed forward,
    copy each token's keys and values to every slot whose row has that context (one write per layer),
    and put each row's first logits at its index in `logits`. Returns the tokens computed."""
    from transformers import DynamicCache

    contexts = [row.context for _, _, row in rows]
    distinct: dict[tuple[int, ...], int] = {}
    owner = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]  # each row's prefilled context
    prefilled = [list(c) for c in distinct]
    sizes = [len(c) for c in prefilled]
    ids, positions = _packed(prefilled, device)
    ends = torch.tensor(sizes, device=device).cumsum(0) - 1  # each context's last token: its logits only
    cache = DynamicCache()
    with _attending_packed(model):
        out = model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            **{cache_keyword(model): cache},
            logits_to_keep=ends,
        )
    lengths = [len(c) for c in contexts]
    slots = torch.tensor([slot for _, slot, _ in rows], device=device)
    n = torch.tensor(lengths, device=device)
    owners = torch.tensor(owner, device=device)
    starts = ends - torch.tensor(sizes, device=device) + 1  # each prefilled context's first packed token
    slot_of = torch.repeat_interleave(slots, n)  # each placed token's slot, and its column there
    column_of = torch.cat([torch.arange(k, device=device) for k in lengths])
    source_of = torch.repeat_interleave(starts[owners], n) + column_of  # where the prefill computed it
    for src, dst in zip(cache.layers, s.layers, strict=True):
        # [1, kv_heads, total, dim] -> [placed, kv_heads, dim], written at (slot, :, column) in place
        dst.keys[slot_of, :, column_of] = src.keys[0][:, source_of].transpose(0, 1).to(dst.keys.dtype)
        dst.values[slot_of, :, column_of] = src.values[0][:, source_of].transpose(0, 1).to(dst.values.dtype)
    first = out.logits[0]
    for (at, _, _), o in zip(rows, owner, strict=True):
        logits[at] = first[o]
    if prefix is not None:
        for u, context in enumerate(prefilled):
            a, b = int(starts[u]), int(ends[u]) + 1
            prefix.put(
                context,
                [src.keys[0][:, a:b].to(dst.keys.dtype) for src, dst in zip(cache.layers, s.layers, strict=True)],
                [src.values[0][:, a:b].to(dst.values.dtype) for src, dst in zip(cache.layers, s.layers, strict=True)],
                first[u],
            )
    return sum(sizes)


def _extend(model, s: Slots, slot: int, row: Row, entry, shared: int, device, prefix, logits: list, at: int) -> int:
    """Seat `row` in `slot` from a cached context sharing its first `shared` tokens: those tokens' keys
    and values copied, the rest of its context computed on top of them (one forward with the cached
    prefix as its past), its first logits at `logits[at]`. A context the entry holds whole, with its
    logits, computes nothing. Returns the tokens computed."""
    from transformers import DynamicCache

    context = row.context
    n = len(context)
    if shared == n and len(entry.tokens) == n and entry.logits is not None:
        for layer, k, v in zip(s.layers, entry.keys, entry.values, strict=True):
            layer.keys[slot, :, :n] = k
            layer.values[slot, :, :n] = v
        logits[at] = entry.logits
        return 0
    shared = min(shared, n - 1)  # at least the last token is computed: its logits are the row's first
    past = DynamicCache()
    for i, (k, v) in enumerate(zip(entry.keys, entry.values, strict=True)):
        past.update(k[None, :, :shared], v[None, :, :shared], i)
    tail = torch.tensor([context[shared:]], device=device)
    out = model(
        input_ids=tail,
        position_ids=torch.arange(shared, n, device=device)[None],
        use_cache=True,
        **{cache_keyword(model): past},
        logits_to_keep=1,
    )
    keys, values = [], []
    for layer, src in zip(s.layers, past.layers, strict=True):
        k, v = src.keys[0].to(layer.keys.dtype), src.values[0].to(layer.values.dtype)  # [kv_heads, n, dim]
        layer.keys[slot, :, :n] = k
        layer.values[slot, :, :n] = v
        keys.append(k)
        values.append(v)
    logits[at] = out.logits[0, -1]
    if prefix is not None:
        prefix.put(context, keys, values, logits[at])
    return n - shared


def keep(s: Slots, slot: int, prefix: PrefixCache) -> None:
    """Put the keys and values `slot` holds (its row's context up to the columns written) into the
    prefix cache, before the slot is parked (a parked slot overwrites its column 0)."""
    n = s.columns[slot]
    tokens = s.rows[slot].context[:n]
    prefix.put(
        tokens, [layer.keys[slot, :, :n] for layer in s.layers], [layer.values[slot, :, :n] for layer in s.layers], None
    )


def park(s: Slots, slot: int) -> None:
    """Free `slot`: it decodes on column 0 alone from now on (its logits finite, never read)."""
    step = s.step
    step.mask[slot] = False
    step.mask[slot, 0, 0, 0] = True
    step.columns[slot] = 0
    step.live[slot] = 0
    s.rows[slot], s.columns[slot] = None, 0
    _refilter(s)


def advanced(s: Slots) -> None:
    """The host's copy of the columns after a decode step: every live slot moved one column on."""
    for i in s.live:
        s.columns[i] += 1


def _refilter(s: Slots) -> None:
    s.filtered = any(r.req.params.top_p < 1 or r.req.params.top_k > 0 for r in s.rows if r is not None)
