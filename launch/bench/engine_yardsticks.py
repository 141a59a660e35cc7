"""The engine stage's two yardsticks, measured in the same run, on the same model, device and workload
as the engine alone (`kiln bench`, launch/bench/stages.py):

* plain HF `generate`: a dynamic cache, eager, HF's own sdpa attention, the stage's max_batch prompts
  left-padded, a fixed number of new tokens (end of sequence ignored), sampling at the rollout's
  temperature: what a user without an inference engine would run;
* HF `generate` with a static cache, which transformers compiles (torch.compile of the decoding
  forward, its default CompileConfig) on a GPU: the fastest HF runs without an engine. The same
  prompts and tokens; one untimed run of the same shape first, which pays the compilation. Where it
  does not run (a CPU, where transformers does not compile generate; a compile that fails) the
  report says why instead of a figure;
* the memory-bandwidth bound of a decode step: every step reads the weights once and the KV cache in
  use once (the stage's mean context: prompt plus half the mean response), at this device's measured
  copy bandwidth, so max_batch rows decode at most `max_batch x bandwidth / bytes per step` tokens a
  second. Compute, the logits' write and the sampling are not in it: it is a bound, not a model.

Only the torch engine has a model in this process to compare; another engine gets no yardsticks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# HF generate's new tokens: the stage's mean response, at most this many (on a CPU a few hundred
# tokens of a dynamic-cache generate take tens of seconds; the rate changes little past it).
HF_NEW_TOKENS_MAX = 256
COPY_BYTES = 256 << 20  # the bandwidth probe's buffer: past any cache, so the figure is memory's
COPY_REPEATS = 5


@dataclass
class EngineYardsticks:
    hf_generate_tokens_per_s: float  # HF generate's decoded tok/s (dynamic cache, eager)
    hf_batch: int  # its prompts (the stage's max_batch)
    hf_new_tokens: int  # new tokens per prompt
    hf_seconds: float
    hf_static_tokens_per_s: float | None  # static cache + torch.compile; None where it did not run
    hf_static_note: str  # why it did not run, or ""
    copy_gb_per_s: float  # the device's copy bandwidth: bytes read plus written per second, best of COPY_REPEATS
    weight_bytes: int
    kv_bytes_per_token: int  # K and V over every layer, one token
    mean_context: float  # tokens of KV a row holds at a mean step: prompt + half the response
    bound_tokens_per_s: float  # max_batch x the steps per second reading weights and KV in use allows


def measure(engine, prompts: list[list[int]], mean_response: float, temperature: float) -> EngineYardsticks | None:
    """The yardsticks for `engine` (a TorchEngine; None for any other), from the stage's `prompts` (its
    max_batch of them are given to HF generate) and its mean response length."""
    from actors.rollout.torch_engine import TorchEngine

    # The benchmark's engine draws its lengths through a wrapper (actors/rollout/workload.py); the
    # model to compare is the wrapped engine's.
    while not isinstance(engine, TorchEngine) and hasattr(engine, "inner"):
        engine = engine.inner
    if not isinstance(engine, TorchEngine) or not prompts:
        return None
    device = engine.device
    batch = min(len(prompts), engine.max_batch)
    new_tokens = max(1, min(HF_NEW_TOKENS_MAX, round(mean_response)))
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    per_token = kv_bytes_per_token(engine.model)
    # HF builds its own model and caches beside the engine's: the engine gives its card back meanwhile
    # (its max_batch x max_seq_len cache and graphs; the weights to the host), or a 1.1B model's static
    # cache found 2 GiB free of an H100's 79 and the compiled yardstick died of memory.
    engine.release_memory()
    try:
        seconds = hf_generate_seconds(engine.model_cfg, device, prompts[:batch], new_tokens, temperature)
        static_s, static_note = hf_static_seconds(engine.model_cfg, device, prompts[:batch], new_tokens, temperature)
    finally:
        engine.resume_memory()
    context = sum(map(len, prompts)) / len(prompts) + mean_response / 2
    bandwidth = copy_bandwidth(device)
    step_s = (weights + engine.max_batch * context * per_token) / bandwidth
    return EngineYardsticks(
        hf_generate_tokens_per_s=batch * new_tokens / seconds,
        hf_batch=batch,
        hf_new_tokens=new_tokens,
        hf_seconds=seconds,
        hf_static_tokens_per_s=batch * new_tokens / static_s if static_s else None,
        hf_static_note=static_note,
        copy_gb_per_s=bandwidth / 1e9,
        weight_bytes=weights,
        kv_bytes_per_token=per_token,
        mean_context=context,
        bound_tokens_per_s=engine.max_batch / step_s,
    )


def hf_static_seconds(
    model_cfg, device: torch.device, prompts: list[list[int]], new_tokens: int, temperature: float
) -> tuple[float | None, str]:
    """HF generate with a static cache (compiled on a GPU): its seconds and "", or None and why not."""
    if torch.device(device).type != "cuda":
        return None, "static cache + torch.compile: GPUs only (transformers compiles generate there)"
    try:
        return hf_generate_seconds(model_cfg, device, prompts, new_tokens, temperature, static=True), ""
    except Exception as err:  # noqa: BLE001 - a compile that fails is a finding, not a crash of the bench
        return None, f"static cache + torch.compile failed: {type(err).__name__}: {str(err)[:160]}"


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of K and V one token holds over every layer, from the model's config and dtype."""
    c = model.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * kv_heads * head_dim * element


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by the best of COPY_REPEATS copies of COPY_BYTES on `device`."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(COPY_REPEATS):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * COPY_BYTES / best


def hf_generate_seconds(
    model_cfg,
    device: torch.device,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    *,
    static: bool = False,
) -> float:
    """Seconds HF generate takes for `new_tokens` after each of `prompts` (left-padded; after an
    untimed warm-up), on a model of `model_cfg` built with HF's own sdpa attention. `static`: a static
    cache (compiled by transformers on a GPU); its warm-up is a whole run of the same shape, since the
    cache's length, and so the compiled graph, follows the new tokens asked for."""
    from actors.policy.model import build_model

    model = build_model(model_cfg, device)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = {"do_sample": temperature > 0, "pad_token_id": 0, "eos_token_id": None}
    if temperature > 0:
        kw.update(temperature=temperature, top_k=0, top_p=1.0)
    if static:
        kw["cache_implementation"] = "static"
    warm = new_tokens if static else 2
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=warm, min_new_tokens=warm, **kw)
            _sync(device)
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
            _sync(device)
            seconds = time.perf_counter() - t
    finally:
        del model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the next yardstick's model and cache get this one's blocks
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"HF generate made {out.shape[1] - width} new tokens, not {new_tokens}")
    return seconds


def _sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
