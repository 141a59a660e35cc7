"""Pick and build the engine a rollout actor drives, from `rollout.engine`:
'torch' (embedded), 'sglang' (SGLang servers launched per actor on the GPUs the placement plan gives
it, or reached at `rollout.sglang.urls`), or a dotted path to a class with `__init__(self, rollout:
RolloutConfig, model: ModelConfig, *, index: int, eos_token_ids: list[int])` implementing
`actors.rollout.engine.Engine`.
"""

from __future__ import annotations

import importlib

from actors.rollout.engine import Engine, EngineError
from configs import ModelConfig, RolloutConfig


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_engine(rollout: RolloutConfig, model: ModelConfig, *, index: int, eos_token_ids: list[int],
                gpu_ids: tuple[str, ...] = ()) -> Engine:
    """`gpu_ids`: the actor's GPUs from the placement plan (`Slot.device_ids()`), where a launched
    SGLang server runs; () leaves the server the devices this process sees."""
    if rollout.engine == "torch":
        from actors.rollout.torch_engine import TorchEngine

        return TorchEngine(model, max_batch=rollout.max_batch, device=resolve_device(rollout.device),
                           eos_token_ids=eos_token_ids, on_weight_update=rollout.on_weight_update,
                           seed=rollout.seed + index)
    if rollout.engine == "sglang":
        from actors.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(rollout, model, index=index, eos_token_ids=eos_token_ids, gpu_ids=gpu_ids)
    module_name, _, attr = rollout.engine.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise EngineError(f"rollout.engine={rollout.engine!r}: {err}") from None
    return cls(rollout, model, index=index, eos_token_ids=eos_token_ids)
