"""The inference-engine interface of the rollout actors (docs/rollout.md), and the types it speaks.

An engine turns token-id prompts into sampled responses with exact behaviour log-probabilities:
log softmax(logits / T) of each sampled token, with no top-p/top-k renormalisation, plus the weight
version that produced each token. Engines also abort, pause, release memory, load new weights and
report their health. Only engine modules (`torch_engine`, `sglang_engine`, `http_client`) import an
engine library; the rollout actor imports this interface.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from protocols import EngineHealth

if TYPE_CHECKING:
    from configs import ModelConfig, RolloutConfig

SUBMIT_THREADS = 256  # requests in flight through the default `Engine.submit`
_SUBMIT_LOCK = threading.Lock()

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0  # filters what is sampled; the reported logprob is never renormalised
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be >= 0 and max_new_tokens >= 1")


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # Forced-response mode (benchmarks only): score these tokens instead of sampling.
    forced_response: list[int] | None = None


@dataclass
class Generation:
    """One finished (or aborted) request: what was sampled, its logprobs and producing versions."""

    request_id: str
    output_ids: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n], log softmax(logits / T) of each output token
    versions: np.ndarray  # int64 [n], weight version that produced each token
    finish_reason: FinishReason
    prompt_tokens: int = 0
    seconds: float = 0.0  # from submission to finish

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class EngineError(RuntimeError):
    """The engine cannot serve (crashed, closed, or refused a request)."""


class RequestError(EngineError):
    """A request the engine can never serve as sent (empty prompt, ids out of vocabulary, too long)."""


class Engine(abc.ABC):
    """What the rollout actor needs from an inference engine.

    An engine plug-in (`rollout.engine: package.module.Class`) subclasses this. The rollout actor
    builds it with `from_config`, whose default calls
    `cls(rollout, model, index=..., eos_token_ids=..., gpu_ids=...)`; an engine whose constructor takes
    other arguments overrides `from_config` (the torch engine does).
    """

    @classmethod
    def from_config(
        cls,
        rollout: RolloutConfig,
        model: ModelConfig,
        *,
        index: int,
        eos_token_ids: list[int],
        gpu_ids: tuple[str, ...] = (),
    ) -> Engine:
        """The engine of rollout actor `index`, stopping at `eos_token_ids`, on the placement plan's
        `gpu_ids` (() = the devices this process sees)."""
        return cls(rollout, model, index=index, eos_token_ids=eos_token_ids, gpu_ids=gpu_ids)

    @abc.abstractmethod
    def generate(self, requests: list[GenerateRequest]) -> list[Generation]:
        """Run the requests (batched with any others in flight); results in request order."""

    def submit(self, request: GenerateRequest) -> Future:
        """Start one request and return its future (a `Generation`, or an `EngineError`). The rollout's
        event loop awaits hundreds of these at once. This default runs `generate([request])` on a
        bounded pool of `SUBMIT_THREADS` threads; engines with their own queue override it."""
        with _SUBMIT_LOCK:
            pool = self.__dict__.get("_submit_pool")
            if pool is None:
                pool = self.__dict__["_submit_pool"] = ThreadPoolExecutor(
                    max_workers=SUBMIT_THREADS, thread_name_prefix="kiln-engine-submit"
                )
        return pool.submit(lambda: self.generate([request])[0])

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Finish the named in-flight requests (all when None) now, with finish_reason 'abort'."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop decoding at the next step boundary; in-flight requests wait."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Colocated mode: give the accelerator memory (weights, KV cache) back until resume_memory."""

    @abc.abstractmethod
    def resume_memory(self) -> None: ...

    @abc.abstractmethod
    def update_weights_from_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors and serve them as `version`."""

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load an HF checkpoint directory (safetensors) and serve it as `version`."""

    @abc.abstractmethod
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join the learner's weight-broadcast group (the learner is rank 0; this engine rank_offset)."""

    @abc.abstractmethod
    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
        *,
        last: bool = True,
        flat: bool = False,
    ) -> None:
        """Receive one bucket that the learner broadcasts in the group. A version may span several
        buckets: `last=False` says more follow, and no token may be sampled by a half-updated model
        under either version; with the last bucket the engine serves `version`. `flat`: the bucket
        (one dtype) comes as one broadcast of its tensors concatenated, else one broadcast per tensor."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int: ...

    @abc.abstractmethod
    def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    def close(self) -> None: ...
