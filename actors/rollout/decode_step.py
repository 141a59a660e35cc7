"""One batched decode step of the torch engine over a static KV cache, eager or CUDA-graph replayed.

The step's inputs live in fixed buffers updated in place (token ids, position ids, the cache column
and a 4-D boolean attention mask over the whole static cache), so every step has the same shapes and
addresses: on GPU the first step is run eagerly, then captured into a CUDA graph that later steps
replay, which removes the per-layer kernel-launch and Python overhead that dominates small-model
decoding. A 4-D mask is passed through by transformers unchanged, so no mask is built (and no host
sync happens) inside the captured step. Sampling stays outside the graph.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


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
    ) -> None:
        self.model, self.cache = model, cache
        self.mask = mask2d.bool()[:, None, None, :].contiguous()  # [B, 1, 1, cache_len]: True = attend
        self.positions = positions.clone()  # [B, 1] position id of each row's next token
        self.column = column  # cache column the next token goes to
        self.cache_position = torch.tensor([column], device=positions.device)
        self.tokens = torch.zeros(positions.shape[0], 1, dtype=torch.long, device=positions.device)
        self.use_graph = cuda_graph and positions.device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    @property
    def cache_len(self) -> int:
        """Columns of the static cache: a step may run only while `column` is below this."""
        return self.mask.shape[-1]

    def _forward(self) -> torch.Tensor:
        out = self.model(
            input_ids=self.tokens,
            attention_mask=self.mask,
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
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        elif self.use_graph:
            logits = self._capture()
        else:
            logits = self._forward()
        self.positions += 1
        self.column += 1
        return logits

    def _capture(self) -> torch.Tensor:
        """Run the step eagerly on a side stream (its result is this step's), then capture it. A
        failed capture is logged and the engine stays eager: slower, never wrong."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self._forward().clone()
        torch.cuda.current_stream().wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work on other threads (an HTTP handler receiving weights) may go on.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = self._forward()
            self.graph = graph
        except RuntimeError as err:
            log.warning("CUDA graph capture of the decode step failed, decoding eagerly: %s", err)
            self.use_graph = False
        return logits
