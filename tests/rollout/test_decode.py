"""The torch engine's decode fast paths on CPU (and on GPU, `gpu` marker): the grouped-query decode
attention gives the logits of HF's sdpa path without taking it, a step reads only the cache columns
in use, each bucket's CUDA graph is captured once across admissions, and the pipelined step (next
decode queued before the host reads this step's tokens) records exactly the tokens, logprobs and
versions of the unpipelined one, with rows finishing at different steps, refills, and a weight update
mid-generation."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from actors.policy import packed_attention
from actors.policy.model import build_model
from actors.rollout import attention, static_batch
from actors.rollout.engine import GenerateRequest, SamplingParams
from actors.rollout.static_batch import Row
from actors.rollout.torch_engine import TorchEngine
from configs import ModelConfig

# 4 query heads over 2 KV heads: the grouped-query case the decode attention re-lays out.
TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=256)
EOS = 257


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def decode_logits(
    model, contexts: list[list[int]], feeds: list[list[int]], device: str = "cpu", steps_seen: list | None = None, **kw
) -> list[torch.Tensor]:
    """`contexts` prefilled into the slots of a cache with room for `feeds`, then one decode step per
    entry of `feeds` ([B] tokens per step), as the engine runs them (static_batch, with `kw` for the
    slots); returns the logits [B, V] of every step, and appends the decode step to `steps_seen`."""
    dev = torch.device(device)
    rows = [Row(GenerateRequest(str(i), ctx, SamplingParams()), Future()) for i, ctx in enumerate(contexts)]
    cache_len = max(map(len, contexts)) + len(feeds)
    slots = static_batch.allocate(model, len(rows), cache_len, dev, cuda_graphs=device == "cuda", **kw)
    static_batch.fill(model, slots, list(enumerate(rows)), dev)
    if steps_seen is not None:
        steps_seen.append(slots.step)
    logits = []
    for tokens in feeds:
        logits.append(slots.step(torch.tensor(tokens, device=device), slots.longest()).float().clone())
        static_batch.advanced(slots)
    return logits


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_a_decode_step_reads_only_the_cache_columns_in_use(monkeypatch, kv_heads):
    """With the engine's attention, a decode step's keys and values are cut to the bucket holding its
    column (here from 4 columns, doubling: 16 while the column is below 16, then the whole 29-column
    cache), grouped-query and not; its logits are those of attention over the whole static cache."""
    check_attended_buckets(monkeypatch, kv_heads, "cpu")


@pytest.mark.gpu
def test_a_decode_step_captures_one_graph_per_attended_bucket_on_gpu(monkeypatch):
    check_attended_buckets(monkeypatch, 2, "cuda")


def check_attended_buckets(monkeypatch, kv_heads: int, device: str) -> None:
    cfg = dataclasses.replace(TINY, num_kv_heads=kv_heads)
    name = attention.register()
    full = build_model(cfg, device)  # HF's sdpa: every step attends over the whole cache
    kiln = build_model(cfg, device, attention=name)
    g = torch.Generator().manual_seed(4)
    contexts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 6)]
    feeds = torch.randint(0, 256, (20, 3), generator=g).tolist()
    ref = decode_logits(full, contexts, feeds, device)
    lengths = []  # the key length of every SDPA call a decode step makes
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        lengths.append(k.shape[-2])
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    steps = []
    got = decode_logits(kiln, contexts, feeds, device, steps_seen=steps, min_attended=4)
    decode = lengths[cfg.num_layers :]  # after the prefill's call per layer
    if device == "cpu":  # a replayed graph calls no Python
        assert decode == [16] * (7 * cfg.num_layers) + [29] * (13 * cfg.num_layers), decode
    elif steps[0].kernel:  # each slot read to its own column by the kernel: one bucket, one graph
        assert sorted(steps[0].graphs) == [29] and steps[0].on_graph
    else:
        assert sorted(steps[0].graphs) == [16, 29] and steps[0].on_graph
    tolerance = 1e-5 if device == "cpu" else 1e-4
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=tolerance, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_decode_kernel_reads_each_slot_up_to_its_own_column_and_no_further_on_gpu(dtype):
    """The Triton decode attention against masked SDPA over the whole cache, grouped-query and not,
    slots at column 0, at the cache's end and between; every key and value past a slot's column is
    NaN, so one read past it would poison that slot's output."""
    from actors.rollout import decode_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    for heads, kv_heads, dim, cache_len in [(16, 8, 64, 4096), (8, 2, 128, 1500), (4, 4, 64, 300), (16, 2, 64, 9000)]:
        batch = 5

        def rand(*shape):
            return torch.randn(*shape, device="cuda", generator=g).to(dtype)

        query = rand(batch, 1, heads, dim).transpose(1, 2)  # HF's layout: heads not contiguous
        key, value = rand(batch, kv_heads, cache_len, dim), rand(batch, kv_heads, cache_len, dim)
        columns = torch.tensor([0, cache_len - 1, 1, min(1023, cache_len - 2), cache_len // 3], device="cuda")
        ref = decode_kernel.reference(query.float(), key.float(), value.float(), columns, dim**-0.5)
        past = torch.arange(cache_len, device="cuda")[None, None, :, None] > columns[:, None, None, None]
        got = decode_kernel.decode_attention(
            query, key.masked_fill(past, float("nan")), value.masked_fill(past, float("nan")), columns, dim**-0.5
        )
        assert got.shape == (batch, 1, heads, dim) and got.dtype == dtype
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float(), ref, atol=tolerance, rtol=0)


def test_an_eager_step_decodes_only_the_slots_up_to_the_highest_live_one():
    """Three live rows in slots 0-2 of eight: an eager step runs the model on the first four slots (the
    power-of-two bucket past the highest live slot), and their logits equal a step over all eight."""
    model = build_model(TINY, "cpu", attention=attention.register())
    g = torch.Generator().manual_seed(6)
    contexts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 8)]
    feeds = torch.randint(0, 256, (4, 8), generator=g)
    batches = []
    model.register_forward_pre_hook(lambda m, args, kw: batches.append(kw["input_ids"].shape[0]), with_kwargs=True)
    results = []
    for bucketed in (False, True):
        slots = static_batch.allocate(model, 8, 32, torch.device("cpu"), cuda_graphs=False)
        rows = [Row(GenerateRequest(str(i), ctx, SamplingParams()), Future()) for i, ctx in enumerate(contexts)]
        static_batch.fill(model, slots, list(enumerate(rows)), torch.device("cpu"))
        assert slots.highest() == 3
        batches.clear()
        steps = []
        for tokens in feeds:
            logits = slots.step(tokens, slots.longest(), slots.highest() if bucketed else None)
            steps.append(logits[:3].clone())
            static_batch.advanced(slots)
        assert batches == [4 if bucketed else 8] * len(feeds)
        results.append(steps)
    for full, bucket in zip(*results, strict=True):
        torch.testing.assert_close(bucket, full, atol=1e-5, rtol=0)


def test_the_packed_prefill_fills_each_slot_as_its_own_forward_would():
    """Contexts of different lengths prefilled together as one packed row (no padding) into slots 3, 0
    and 1: each slot's keys, values, mask, column and logits are those of a forward over that context
    alone, and the slot left out stays parked."""
    from transformers import DynamicCache

    model = build_model(TINY, "cpu", attention=attention.register())
    g = torch.Generator().manual_seed(5)
    contexts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 19, 2)]
    rows = [Row(GenerateRequest(str(i), ctx, SamplingParams()), Future()) for i, ctx in enumerate(contexts)]
    slots = static_batch.allocate(model, 4, 32, torch.device("cpu"), cuda_graphs=False)
    static_batch.fill(model, slots, list(zip([3, 0, 1], rows, strict=True)), torch.device("cpu"))
    assert slots.live == [0, 1, 3] and slots.columns == [19, 2, 0, 7]
    for slot, ctx in zip([3, 0, 1], contexts, strict=True):
        alone = DynamicCache()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx]), use_cache=True, past_key_values=alone).logits[0, -1]
        n = len(ctx)
        for src, dst in zip(alone.layers, slots.layers, strict=True):
            torch.testing.assert_close(dst.keys[slot, :, :n], src.keys[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(dst.values[slot, :, :n], src.values[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(slots.logits[slot], logits, atol=1e-4, rtol=0)
        assert slots.step.mask[slot, 0, 0].tolist() == [c < n for c in range(32)]
        assert int(slots.step.columns[slot]) == n
    assert slots.step.mask[2, 0, 0].tolist() == [c == 0 for c in range(32)]  # parked
    assert model.config._attn_implementation == attention.KILN_ATTENTION


def test_grouped_query_decode_attention_matches_hf_sdpa_without_repeating_kv(monkeypatch):
    check_decode_attention(monkeypatch, "cpu")


@pytest.mark.gpu
def test_grouped_query_decode_attention_on_gpu_in_a_cuda_graph(monkeypatch):
    check_decode_attention(monkeypatch, "cuda")


def check_decode_attention(monkeypatch, device: str) -> None:
    name = attention.register()
    assert name == attention.KILN_ATTENTION
    hf_model = build_model(TINY, device)
    kiln_model = build_model(TINY, device, attention=name)
    assert kiln_model.config._attn_implementation == name
    g = torch.Generator().manual_seed(3)
    contexts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 6)]
    feeds = torch.randint(0, 256, (5, 3), generator=g).tolist()
    ref = decode_logits(hf_model, contexts, feeds, device)

    plain_calls, packed_calls = [], []  # HF's own sdpa function: never taken; the prefill's packed one
    real, real_packed = hf_sdpa.sdpa_attention_forward, packed_attention._attend
    monkeypatch.setattr(
        hf_sdpa,
        "sdpa_attention_forward",
        lambda module, query, *a, **kw: plain_calls.append(query.shape[2]) or real(module, query, *a, **kw),
    )
    monkeypatch.setattr(
        packed_attention, "_attend", lambda query, *a: packed_calls.append(query.shape[2]) or real_packed(query, *a)
    )
    got = decode_logits(kiln_model, contexts, feeds, device)
    assert not plain_calls
    assert packed_calls == [sum(map(len, contexts))] * TINY.num_layers  # the prefill: one packed row per layer
    assert kiln_model.config._attn_implementation == name  # the engine's attention again after the prefill
    tolerance = 1e-5 if device == "cpu" else 1e-4  # GPU: different SDPA kernels, fp32 accumulation order
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=tolerance, rtol=0)
    # sanity: the steps' logits differ from each other (the comparison is not of constants)
    assert not torch.allclose(ref[0], ref[-1])


def run_engine(pipeline: bool, update_at: int | None = None, device: str = "cpu") -> tuple[list, dict]:
    """7 requests through 3 slots with different lengths, temperatures and stop sets (rows end at
    different steps, by stop and by length; finished rows are refilled), optionally new weights
    (version 1) applied after decode step `update_at`; same seed whatever `pipeline` is."""
    engine = TorchEngine(
        TINY, max_batch=3, eos_token_ids=[EOS], on_weight_update="abort", seed=5, pipeline=pipeline, device=device
    )
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(7):
        prompt = [256] + torch.randint(0, 256, (2 + 3 * i,), generator=g).tolist()
        stops = tuple(range(0, 256, 7)) if i % 3 == 0 else ()  # some rows stop early, at varying steps
        params = SamplingParams(
            temperature=(0.8, 1.0, 1.3)[i % 3],
            top_p=0.95 if i == 4 else 1.0,
            max_new_tokens=3 + 4 * i,
            stop_token_ids=stops,
        )
        reqs.append(GenerateRequest(str(i), prompt, params))
    try:
        if update_at is None:
            return engine.generate(reqs), dict(engine.stats)
        reached = threading.Event()

        def hook(step: int) -> None:
            if step == update_at:
                engine.pause()
                reached.set()

        engine.step_hook = hook
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("gens", engine.generate(reqs)))
        worker.start()
        assert reached.wait(30)
        new = build_model(dataclasses.replace(TINY, seed=11))
        engine.update_weights_from_tensors(list(new.state_dict().items()), version=1)
        engine.resume()
        worker.join(30)
        return out["gens"], dict(engine.stats)
    finally:
        engine.close()


@pytest.mark.parametrize("update_at", [None, 6])
def test_pipelined_decode_records_the_same_tokens_logprobs_and_versions(update_at):
    check_pipelined_against_plain(update_at, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("update_at", [None, 6])
def test_pipelined_decode_on_gpu_with_cuda_graphs_records_the_same_tokens(update_at):
    check_pipelined_against_plain(update_at, "cuda")


def check_pipelined_against_plain(update_at: int | None, device: str) -> None:
    plain, plain_stats = run_engine(pipeline=False, update_at=update_at, device=device)
    piped, piped_stats = run_engine(pipeline=True, update_at=update_at, device=device)
    if device == "cuda":
        assert piped_stats["graph_steps"] > 0
    assert plain_stats["rebuilds"] + plain_stats["inserted"] >= 3 and plain_stats["inserted"] >= 1  # refills happened
    reasons = {g.finish_reason for g in plain}
    assert reasons == {"stop", "length"}  # rows ended both ways
    assert len({len(g.output_ids) for g in plain}) >= 4  # ... at different steps
    if update_at is not None:
        assert plain_stats["updates"] == piped_stats["updates"] == 1
        assert any(set(g.versions.tolist()) == {0, 1} for g in plain)  # a row spans the update
    for a, b in zip(plain, piped, strict=True):
        assert a.request_id == b.request_id and a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.versions, b.versions)
    assert piped_stats["tokens"] == plain_stats["tokens"] == sum(len(g.output_ids) for g in plain)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bfloat16_engine_admits_rows_of_any_length_with_the_logprobs_of_a_full_forward(device):
    """The engine in the dtype it serves in: bfloat16 slots filled by right-padded prefills of several
    rows at once (admissions batched), decoded to their own columns; every row's behaviour logprobs
    within bf16 noise of a full forward of the same model."""
    from tests.helpers.common import reference_logprobs

    cfg = dataclasses.replace(TINY, dtype="bfloat16", max_seq_len=512)
    engine = TorchEngine(cfg, max_batch=4, device=device, seed=3, admit_batch=2)
    g = torch.Generator().manual_seed(5)
    reqs = [
        GenerateRequest(
            str(i),
            [256] + torch.randint(0, 256, (3 + 37 * (i % 4),), generator=g).tolist(),
            SamplingParams(max_new_tokens=12 + 9 * (i % 3), ignore_eos=True),
        )
        for i in range(9)
    ]
    try:
        gens = engine.generate(reqs)
        for req, gen in zip(reqs, gens, strict=True):
            assert len(gen.output_ids) == req.params.max_new_tokens
            ref = reference_logprobs(engine.model, req.prompt_ids, gen.output_ids.tolist())
            assert np.abs(ref - gen.logprobs).mean() < 0.05, req.request_id
    finally:
        engine.close()


@pytest.mark.gpu
def test_each_bucket_is_captured_once_across_admissions_on_gpu(monkeypatch):
    """Requests of different lengths admitted one after another into two slots on cuda: each attended
    bucket's graph is captured once for the engine's life (admissions change buffer contents, never
    addresses) and later steps replay it; the logprobs stay those of a full forward."""
    from actors.rollout.decode_step import DecodeStep
    from tests.helpers.common import reference_logprobs

    captures = []
    real = DecodeStep._capture
    monkeypatch.setattr(
        DecodeStep, "_capture", lambda self, attended: captures.append(attended) or real(self, attended)
    )
    engine = TorchEngine(dataclasses.replace(TINY, max_seq_len=1024), max_batch=2, device="cuda", seed=2)
    g = torch.Generator().manual_seed(9)
    reqs = [
        GenerateRequest(
            str(i),
            [256] + torch.randint(0, 256, (5 + 150 * (i % 3),), generator=g).tolist(),
            SamplingParams(max_new_tokens=40 + 30 * (i % 2), ignore_eos=True),
        )
        for i in range(6)
    ]
    try:
        gens = engine.generate(reqs)
        assert engine.stats["rebuilds"] == 0 and engine.stats["inserted"] == len(reqs)
        assert captures and len(captures) == len(set(captures)), captures  # one capture per bucket
        assert engine.stats["graph_steps"] > len(captures)  # replayed after capture
        for req, gen in zip(reqs, gens, strict=True):
            ref = reference_logprobs(engine.model, req.prompt_ids, gen.output_ids.tolist())
            assert np.abs(ref - gen.logprobs).mean() < 1e-3, req.request_id
    finally:
        engine.close()
