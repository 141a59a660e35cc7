"""Benchmark workloads on the engine side (`rollout.bench`, used by `kiln bench`): sampled response
lengths with a long tail.

A random-init policy emits eos at random, so its response lengths say nothing about a real
workload. With `rollout.bench.lengths` set, `make_engine` wraps the engine in `SampledLengthEngine`:
every sampled request (not a forced one, which is scored, not decoded) gets a `max_new_tokens` drawn
from `lengths` with `length_weights` and ignores eos and stop ids, so the engine decodes exactly that many tokens
(fewer only where the model's context ends). The tokens are still sampled from the policy with
exact logprobs and versions; only where a response ends is chosen by the benchmark. Each engine
draws from its own seeded stream, so a run and a standalone measurement of one config see the same
distribution.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from actors.rollout.engine import Engine, GenerateRequest, Generation
from protocols import EngineHealth


class LengthDraw:
    """Draws response lengths: `lengths[i]` with probability `weights[i]` (normalised; none = uniform)."""

    def __init__(self, lengths: Sequence[int], weights: Sequence[float] = (), seed: int = 0) -> None:
        if not lengths or any(n < 1 for n in lengths):
            raise ValueError(f"lengths must be a non-empty list of positive token counts, got {list(lengths)}")
        if weights and (len(weights) != len(lengths) or any(w < 0 for w in weights) or sum(weights) <= 0):
            raise ValueError(f"weights {list(weights)} must give one non-negative weight per length, not all zero")
        self.lengths = [int(n) for n in lengths]
        self.weights = [float(w) for w in weights] if weights else [1.0] * len(self.lengths)
        self.rng = random.Random(seed)

    def __call__(self) -> int:
        return self.rng.choices(self.lengths, self.weights)[0]

    @property
    def mean(self) -> float:
        return sum(n * w for n, w in zip(self.lengths, self.weights, strict=True)) / sum(self.weights)


class SampledLengthEngine(Engine):
    """Any engine, with each sampled request's length drawn by `draw` (eos ignored)."""

    def __init__(self, engine: Engine, draw: LengthDraw) -> None:
        self.inner, self.draw = engine, draw

    def shaped(self, request: GenerateRequest) -> GenerateRequest:
        if request.forced_response is not None:
            return request
        # No stop at all: neither eos nor the chat template's end of turn ends a drawn length early.
        params = dataclasses.replace(request.params, max_new_tokens=self.draw(), ignore_eos=True, stop_token_ids=())
        return dataclasses.replace(request, params=params)

    def generate(self, requests: list[GenerateRequest]) -> list[Generation]:
        return self.inner.generate([self.shaped(r) for r in requests])

    # Everything else is the wrapped engine's, whatever its signature (so a change to the Engine
    # interface never reaches this file), and so is every attribute the Engine interface does not name
    # (`device`, which the cuda_ipc transport reads).

    def abort(self, *args, **kwargs):
        return self.inner.abort(*args, **kwargs)

    def pause(self, *args, **kwargs):
        return self.inner.pause(*args, **kwargs)

    def resume(self, *args, **kwargs):
        return self.inner.resume(*args, **kwargs)

    def release_memory(self, *args, **kwargs):
        return self.inner.release_memory(*args, **kwargs)

    def resume_memory(self, *args, **kwargs):
        return self.inner.resume_memory(*args, **kwargs)

    def update_weights_from_tensors(self, *args, **kwargs):
        return self.inner.update_weights_from_tensors(*args, **kwargs)

    def update_weights_from_disk(self, *args, **kwargs):
        return self.inner.update_weights_from_disk(*args, **kwargs)

    def init_weights_update_group(self, *args, **kwargs):
        return self.inner.init_weights_update_group(*args, **kwargs)

    def update_weights_from_distributed(self, *args, **kwargs):
        return self.inner.update_weights_from_distributed(*args, **kwargs)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def health(self) -> EngineHealth:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
