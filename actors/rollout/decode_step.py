"""One batched decode step of the torch engine over its slot cache, eager or CUDA-graph replayed.

The step's inputs live in fixed buffers updated in place (token ids, each slot's column, which is also
its position id, whether each slot is live, and a 4-D boolean attention mask over the cache), so every
step has the same shapes and addresses: on GPU the first step of a bucket is run eagerly, then
captured into a CUDA graph that later steps replay, which removes the per-layer kernel-launch and
Python overhead that dominates small-model decoding. A 4-D mask is passed through by transformers
unchanged, so no mask is built (and no host sync happens) inside the captured step. Sampling, the
mask's new column and the columns' advance stay outside the graph.

Attention reads only the columns in use. On CUDA with triton, each slot's column goes through the model
to the engine's attention function (attention.DECODE_COLUMNS), whose kernel (decode_kernel.py) reads
every slot's keys and values up to that slot's own column: one bucket (the whole cache), one graph,
and a step costs what the slots hold, not what the longest one holds. That single shape is also
compiled once (torch.compile: the norms, rotary embedding, activation and residual adds fused; with the kernel, 9.6 ->
2.8 ms a step on an H200, docs/BENCHMARKS.md) and the compiled step is what the graph captures; the
compiled code is kept per process, so a cache allocated again reuses it. Otherwise (CPU, or no
triton) under the engine's attention function (attention.py) the
mask the model sees covers the first `attended` columns of the cache, a bucket just past the largest
column any slot writes: MIN_ATTENDED, doubling, up to the whole cache. So a step over a 8,192-column
cache whose rows have used at most 700 reads 1,024 positions. Each bucket has its graph, captured the
first time a step needs it and replayed for the engine's life: the buffers never move, admissions
and finished rows only change their contents (static_batch.py). The columns past the bucket are
masked for every row, so the logits are the same as over the whole cache. Buckets are replayed in any
order (slots' lengths shrink when a long row finishes), so each graph has a memory pool of its own.

An eager step (no graph) also runs only the slots up to the power of two past the highest live one,
on views of the same cache (`rows`); a captured step always runs them all (one shape per graph).
"""

from __future__ import annotations

import functools
import logging

import torch

from actors.policy.model import cache_keyword

log = logging.getLogger(__name__)

# The smallest attended bucket, in cache columns; buckets double from here up to the whole cache.
MIN_ATTENDED = 256


class DecodeStep:
    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        mask: torch.Tensor,
        columns: torch.Tensor,
        *,
        cuda_graph: bool,
        min_attended: int = MIN_ATTENDED,
        compiled: bool = True,
    ) -> None:
        from actors.rollout import decode_kernel
        from actors.rollout.attention import KILN_ATTENTION

        self.model, self.cache = model, cache
        self.cache_as = cache_keyword(model)  # the forward's keyword for the cache
        self.mask = mask  # [B, 1, 1, cache_len] bool: True = the slot attends to the column
        self.columns = columns  # [B] long: the column (and position id) each slot's next token goes to
        self.live = torch.zeros_like(columns)  # [B]: 1 for a slot holding a request (its column advances)
        self.tokens = torch.zeros(columns.shape[0], 1, dtype=torch.long, device=columns.device)
        self.use_graph = cuda_graph and columns.device.type == "cuda"
        # Only the engine's attention function cuts keys and values to the mask; under any other the
        # mask covers the whole cache.
        ours = getattr(model.config, "_attn_implementation", "") == KILN_ATTENTION
        self.min_attended = min_attended if ours else 0
        # Each slot's keys up to its own column, by the kernel: no buckets (the mask is then not read).
        self.kernel = ours and columns.device.type == "cuda" and decode_kernel.available()
        # With the kernel the step has one shape for the cache's life, so it is compiled once (the
        # norms, rotary embedding, activation and residual adds fused) and captured compiled.
        self.compiled = compiled and self.kernel and self.use_graph
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # attended -> (graph, its logits)
        self.views: dict[int, object] = {}  # rows -> the cache over the first `rows` slots (eager steps)
        # [B, V] float32, given by static_batch.allocate: where eager steps write their logits (the
        # slots past a step's rows keep stale ones; they are parked, never read)
        self.logits: torch.Tensor | None = None
        self.on_graph = False  # the last step replayed (or captured) a graph

    @property
    def cache_len(self) -> int:
        """Columns of the cache: a slot may decode only while its column is below this."""
        return self.mask.shape[-1]

    def attended(self, longest: int) -> int:
        """How many cache columns a step reads whose largest written column is `longest` - 1."""
        if self.kernel or not self.min_attended:
            return self.cache_len
        n = self.min_attended
        while n < longest:
            n *= 2
        return min(n, self.cache_len)

    def rows(self, highest: int | None) -> int:
        """Slots an eager step decodes when the live ones all sit below `highest`: the power of two at or
        above it (the slots past it are parked; their logits are never read). A captured step always
        decodes every slot (one graph per shape; on GPU a parked slot costs little)."""
        batch = self.columns.shape[0]
        if self.use_graph or highest is None:
            return batch
        n = 1
        while n < highest:
            n *= 2
        return min(n, batch)

    def _view(self, rows: int):
        """The cache over the first `rows` slots: views of the same buffers (SlotLayer.head), made once."""
        from transformers.cache_utils import Cache

        if rows not in self.views:
            self.views[rows] = Cache(layers=[layer.head(rows) for layer in self.cache.layers])
        return self.views[rows]

    def _forward(self, attended: int, rows: int | None = None) -> torch.Tensor:
        rows = rows or self.columns.shape[0]
        args = (
            self.model,
            self.tokens[:rows],
            self.mask[:rows, ..., :attended],
            self.columns[:rows],
            self.cache if rows == self.columns.shape[0] else self._view(rows),
            self.kernel,
            self.cache_as,
        )
        if self.compiled:
            try:
                return _compiled_forward()(*args)
            except Exception as err:  # noqa: BLE001 - any compiler failure: the eager step is slower, never wrong
                log.warning("compiling the decode step failed, decoding uncompiled: %s", err)
                self.compiled = False
        return _forward(*args)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, longest: int, highest: int | None = None) -> torch.Tensor:
        """Feed each slot's sampled token; returns logits [B, V] predicting the next one. `longest`: one
        past the largest column a slot writes in this step; `highest`: one past the highest live slot
        (the host knows both: Slots.longest, Slots.highest; None: every slot)."""
        self.tokens.copy_(tokens[:, None])
        self.mask.scatter_(3, self.columns.view(-1, 1, 1, 1), True)
        attended = self.attended(longest)
        captured = self.graphs.get(attended)
        if captured is not None:
            captured[0].replay()
            logits = captured[1]
        elif self.use_graph:
            logits = self._capture(attended)
        else:
            rows = self.rows(highest)
            logits = self.logits
            logits[:rows] = self._forward(attended, rows)
        self.on_graph = attended in self.graphs
        self.columns.add_(self.live)
        return logits

    def _capture(self, attended: int) -> torch.Tensor:
        """Run the step eagerly on a side stream (its result is this step's), then capture it for
        this bucket. A failed capture is logged and the engine stays eager: slower, never wrong. The
        eager run has written this step's keys and values; the capture writes the same ones again."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self._forward(attended).clone()
        torch.cuda.current_stream().wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work on other threads (an HTTP handler receiving weights) may go on.
            with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local"):
                out = self._forward(attended)
            self.graphs[attended] = (graph, out)
        except RuntimeError as err:
            log.warning("CUDA graph capture of the decode step failed, decoding eagerly: %s", err)
            self.use_graph = False
        return logits


def _forward(model, tokens, mask, columns, cache, kernel: bool, cache_as: str) -> torch.Tensor:
    """The model's logits [B, V] for one token per slot (`kernel`: pass each slot's column to the
    engine's attention, attention.DECODE_COLUMNS; `cache_as`: the forward's keyword for the cache)."""
    from actors.rollout.attention import DECODE_COLUMNS

    out = model(
        input_ids=tokens,
        attention_mask=mask,
        position_ids=columns[:, None],
        use_cache=True,
        **{cache_as: cache},
        **({DECODE_COLUMNS: columns} if kernel else {}),
    )
    return out.logits[:, -1]


@functools.cache
def _compiled_forward():
    """`_forward` compiled, one per process: a new cache of the same shapes (the engine's memory given
    back and taken again) reuses the compiled code instead of compiling again."""
    return torch.compile(_forward, dynamic=False)
