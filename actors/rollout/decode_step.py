"""One batched decode step of the torch engine over a static KV cache, eager or CUDA-graph replayed.

The step's inputs live in fixed buffers updated in place (token ids, position ids, the cache column
and a 4-D boolean attention mask over the static cache), so every step has the same shapes and
addresses: on GPU the first step is run eagerly, then captured into a CUDA graph that later steps
replay, which removes the per-layer kernel-launch and Python overhead that dominates small-model
decoding. A 4-D mask is passed through by transformers unchanged, so no mask is built (and no host
sync happens) inside the captured step. Sampling stays outside the graph.

Attention reads only the columns in use. Under the engine's attention function (attention.py) the
mask the model sees covers the first `attended` columns of the cache, a bucket just past the current
column: MIN_ATTENDED, doubling, up to the whole cache. So a step over a 8,192-column cache whose rows
have used 700 reads 1,024 positions, at most twice what is in use. Each bucket has its graph, captured
the first time the column reaches it (a handful per batch, all in one memory pool); the columns
past the bucket are masked for every row, so the logits are the same as over the whole cache.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# The smallest attended bucket, in cache columns; buckets double from here up to the whole cache.
MIN_ATTENDED = 256


class DecodeStep:
    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        mask2d: torch.Tensor,
        positions: torch.Tensor,
        column: int,
        *,
        cuda_graph: bool,
        min_attended: int = MIN_ATTENDED,
    ) -> None:
        from actors.rollout.attention import KILN_ATTENTION

        self.model, self.cache = model, cache
        self.mask = mask2d.bool()[:, None, None, :].contiguous()  # [B, 1, 1, cache_len]: True = attend
        self.positions = positions.clone()  # [B, 1] position id of each row's next token
        self.column = column  # cache column the next token goes to
        self.cache_position = torch.tensor([column], device=positions.device)
        self.tokens = torch.zeros(positions.shape[0], 1, dtype=torch.long, device=positions.device)
        self.use_graph = cuda_graph and positions.device.type == "cuda"
        # Only the engine's attention function cuts keys and values to the mask; under any other the
        # mask covers the whole cache.
        self.min_attended = min_attended if getattr(model.config, "_attn_implementation", "") == KILN_ATTENTION else 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # attended -> (graph, its logits)
        # The graphs' shared memory pool. Sharing is safe because the column only grows: a bucket's
        # graph is never replayed after a later bucket's was captured, and each graph's logits stay
        # referenced, so no later capture is given their memory.
        self.pool = None
        self.on_graph = False  # the last step replayed (or captured) a graph

    @property
    def cache_len(self) -> int:
        """Columns of the static cache: a step may run only while `column` is below this."""
        return self.mask.shape[-1]

    def attended(self) -> int:
        """How many cache columns the next step reads: the bucket that holds its column."""
        if not self.min_attended:
            return self.cache_len
        n = self.min_attended
        while n <= self.column:
            n *= 2
        return min(n, self.cache_len)

    def _forward(self, attended: int) -> torch.Tensor:
        out = self.model(
            input_ids=self.tokens,
            attention_mask=self.mask[..., :attended],
            position_ids=self.positions,
            past_key_values=self.cache,
            cache_position=self.cache_position,
            use_cache=True,
        )
        return out.logits[:, -1]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row's sampled token; returns logits [B, V] predicting the next one."""
        self.tokens.copy_(tokens[:, None])
        self.mask[:, 0, 0, self.column] = True
        self.cache_position.fill_(self.column)
        attended = self.attended()
        captured = self.graphs.get(attended)
        if captured is not None:
            captured[0].replay()
            logits = captured[1]
        elif self.use_graph:
            logits = self._capture(attended)
        else:
            logits = self._forward(attended)
        self.on_graph = attended in self.graphs
        self.positions += 1
        self.column += 1
        return logits

    def _capture(self, attended: int) -> torch.Tensor:
        """Run the step eagerly on a side stream (its result is this step's), then capture it for
        this bucket. A failed capture is logged and the engine stays eager: slower, never wrong."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self._forward(attended).clone()
        torch.cuda.current_stream().wait_stream(stream)
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work on other threads (an HTTP handler receiving weights) may go on.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._forward(attended)
            self.graphs[attended] = (graph, out)
        except RuntimeError as err:
            log.warning("CUDA graph capture of the decode step failed, decoding eagerly: %s", err)
            self.use_graph = False
        return logits
