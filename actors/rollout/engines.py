"""Pick and build the engine a rollout actor drives, from `rollout.engine`: 'torch' (the embedded
engine), 'sglang' (SGLang servers launched per actor on the GPUs the placement plan gives it, or
reached at `rollout.sglang.urls`), or the dotted path of any `actors.rollout.engine.Engine` subclass,
loaded by the one plug-in loader (`actors.base.load_plugin`) and built with `Engine.from_config`.
"""

from __future__ import annotations

from actors.base import load_plugin
from actors.rollout.engine import Engine
from configs import ModelConfig, RolloutConfig

BUILT_IN = {
    "torch": "actors.rollout.torch_engine.TorchEngine",
    "sglang": "actors.rollout.sglang_engine.SGLangEngine",
}


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_class(name: str) -> type[Engine]:
    """The engine class `rollout.engine` names (a built-in name or a dotted path); PluginError if unusable."""
    return load_plugin(BUILT_IN.get(name, name), Engine, key="rollout.engine")


def make_engine(
    rollout: RolloutConfig, model: ModelConfig, *, index: int, eos_token_ids: list[int], gpu_ids: tuple[str, ...] = ()
) -> Engine:
    """`gpu_ids`: the actor's GPUs from the placement plan (`Slot.device_ids()`), where a launched
    SGLang server runs; () leaves the engine the devices this process sees. With the benchmark's
    sampled lengths (`rollout.bench.lengths`) the engine is wrapped to draw them (actors/rollout/workload.py)."""
    engine = engine_class(rollout.engine).from_config(
        rollout, model, index=index, eos_token_ids=eos_token_ids, gpu_ids=gpu_ids
    )
    if not rollout.bench.lengths:
        return engine
    from actors.rollout.workload import LengthDraw, SampledLengthEngine

    draw = LengthDraw(rollout.bench.lengths, rollout.bench.length_weights, seed=rollout.seed + index)
    return SampledLengthEngine(engine, draw)
