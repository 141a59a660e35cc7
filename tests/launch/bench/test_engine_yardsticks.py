"""The engine stage's yardsticks (launch/bench/engine_yardsticks.py): plain HF generate on the same
model and prompts, run for real, and the decode bound from the model's own bytes."""

from __future__ import annotations

import dataclasses

import pytest

from actors.rollout.engine import GenerateRequest, SamplingParams
from actors.rollout.torch_engine import TorchEngine
from actors.rollout.workload import LengthDraw, SampledLengthEngine
from configs import ModelConfig
from launch.bench import engine_yardsticks
from launch.bench.report import _yardsticks
from launch.bench.stages import EngineStage

TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=256)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_hf_generate_and_the_decode_bound_are_measured_on_the_engines_model():
    engine = TorchEngine(TINY, max_batch=3, seed=1, device="cpu")
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]
        y = engine_yardsticks.measure(engine, prompts, mean_response=20.4, temperature=1.0)
    finally:
        engine.close()
    assert y is not None and y.hf_batch == 3 and y.hf_new_tokens == 20  # max_batch prompts, the mean response
    assert y.hf_generate_tokens_per_s == pytest.approx(3 * 20 / y.hf_seconds)
    # K and V, 2 layers, 2 KV heads of 16 dims, fp32
    assert y.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert y.weight_bytes == sum(p.numel() * 4 for p in engine.model.parameters())
    assert y.mean_context == pytest.approx(14 / 4 + 10.2)
    step_bytes = y.weight_bytes + 3 * y.mean_context * y.kv_bytes_per_token
    assert y.bound_tokens_per_s == pytest.approx(3 * y.copy_gb_per_s * 1e9 / step_bytes)
    assert y.copy_gb_per_s > 0.1
    # On a CPU transformers does not compile generate: the static-cache yardstick says so, with no figure.
    assert y.hf_static_tokens_per_s is None and "GPUs only" in y.hf_static_note
    stage = EngineStage(50.0, 4, 80, 1.6, 3, 1, 20.0, yardsticks=y)
    hf, static, bound = _yardsticks(stage)
    assert "HF generate" in hf and f"{50.0 / y.hf_generate_tokens_per_s:.2f}×" in hf
    assert "static cache + torch.compile | not run | static cache + torch.compile: GPUs only" in static
    assert "decode bound" in bound and f"{50.0 / y.bound_tokens_per_s:.1%}" in bound
    timed = dataclasses.replace(y, hf_static_tokens_per_s=25.0, hf_static_note="")
    assert (
        "25.0 decoded tok/s: the engine 2.00×"
        in _yardsticks(EngineStage(50.0, 4, 80, 1.6, 3, 1, 20.0, yardsticks=timed))[1]
    )
    assert _yardsticks(EngineStage(50.0, 4, 80, 1.6, 3, 1, 20.0)) == []


def test_the_benchmarks_sampled_length_engine_is_measured_through_its_wrapper():
    """`kiln bench` wraps the engine to draw its lengths (`rollout.bench.lengths`); the yardsticks
    measure the wrapped engine's model, not nothing."""
    engine = TorchEngine(TINY, max_batch=2, seed=1, device="cpu")
    try:
        wrapped = SampledLengthEngine(engine, LengthDraw([4], [1.0], seed=0))
        y = engine_yardsticks.measure(wrapped, [[1, 2, 3], [4, 5]], mean_response=4.0, temperature=1.0)
    finally:
        engine.close()
    assert y is not None and y.hf_batch == 2 and y.hf_new_tokens == 4
    assert y.weight_bytes == sum(p.numel() * 4 for p in engine.model.parameters())


def test_hf_generate_runs_while_the_engine_has_given_its_memory_back(monkeypatch):
    """HF's models and caches are built beside the engine's: the engine releases its cache and graphs
    while they run (a 1.1B model's static cache found 2 GiB of an H100 free otherwise), and serves
    again after."""
    engine = TorchEngine(TINY, max_batch=2, seed=1, device="cpu")
    released_during: list[bool] = []
    real = engine_yardsticks.hf_generate_seconds

    def watched(*args, **kwargs):
        released_during.append(engine._released and engine._slots is None)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_yardsticks, "hf_generate_seconds", watched)
    try:
        engine.generate([GenerateRequest("before", [1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))])
        assert engine._slots is not None
        engine_yardsticks.measure(engine, [[1, 2, 3], [4, 5]], mean_response=4.0, temperature=1.0)
        assert released_during == [True] and not engine._released
        (after,) = engine.generate(
            [GenerateRequest("after", [1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True))]
        )
        assert len(after.output_ids) == 3
    finally:
        engine.close()


def test_an_engine_without_a_model_here_gets_no_yardsticks():
    assert engine_yardsticks.measure(object(), [[1, 2]], 8.0, 1.0) is None


def test_hf_generate_with_a_static_cache_makes_the_tokens_asked_for():
    """The static-cache yardstick's own call, on a CPU (where transformers leaves it uncompiled): the
    cache is sized from the same prompts and new tokens, and the run makes exactly those tokens (it
    raises otherwise). On a GPU the same call is compiled by transformers (docs/BENCHMARKS.md)."""
    seconds = engine_yardsticks.hf_generate_seconds(
        TINY, "cpu", [[1, 2, 3], [4, 5, 6, 7, 8]], new_tokens=6, temperature=1.0, static=True
    )
    assert seconds > 0
