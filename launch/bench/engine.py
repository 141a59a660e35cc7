"""GPU benchmark of the embedded torch engine (docs/rollout.md targets), run on the GPU machine:

    python -m launch.bench.engine            # ~0.3B Qwen3-style model, random init, bf16

1. Decode throughput: the engine vs HF `generate` on the same model and device in the same run,
   batch 64, prompt 512, 512 generated tokens (EOS ignored), logprobs on for both.
2. The memory-bandwidth roofline of the engine's decode (bytes a step must read / HBM bandwidth).
3. Logprob mismatch in bf16: the engine's behaviour logprobs vs a full-sequence forward of the same
   bf16 model on the same tokens (and vs an fp32 copy), as a distribution over all tokens.

Prints one table. No hub access: the model is built from a config with random init.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import numpy as np
import torch

from actors.rollout.engine import GenerateRequest, SamplingParams
from actors.rollout.torch_engine import TorchEngine
from configs import ModelConfig

# ~0.3B parameters: 12 layers of width 1024 (151M) + a tied 151,936-token embedding (156M).
QWEN3_0_3B = ModelConfig(
    arch="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    num_layers=12,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=3072,
    max_seq_len=2048,
    dtype="bfloat16",
)
HBM_TBPS = {"H100": 3.35, "H200": 4.8, "A100": 2.0}  # SXM peak HBM bandwidth, TB/s


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench_engine(
    cfg: ModelConfig,
    prompts: list[list[int]],
    new_tokens: int,
    graphs: bool,
    pipeline: bool = True,
    gqa_decode: bool = True,
):
    engine = TorchEngine(
        cfg, max_batch=len(prompts), device=DEVICE, cuda_graphs=graphs, seed=0, pipeline=pipeline, gqa_decode=gqa_decode
    )
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.generate([GenerateRequest(f"w{i}", p, warm) for i, p in enumerate(prompts)])
    sync()
    t = time.perf_counter()
    gens = engine.generate([GenerateRequest(str(i), p, params) for i, p in enumerate(prompts)])
    sync()
    return engine, gens, time.perf_counter() - t


def bench_hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device=DEVICE)
    kw = {
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "output_logits": True,
        "return_dict_in_generate": True,
        "pad_token_id": 0,
    }
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        new = out.sequences[:, ids.shape[1] :]
        # logprobs on: log softmax of each sampled token, as the engine reports them (step by step, so
        # no [B, N, V] fp32 tensor is ever materialised)
        lp = torch.stack(
            [torch.log_softmax(l.float(), -1).gather(1, new[:, i : i + 1])[:, 0] for i, l in enumerate(out.logits)], 1
        )
        sync()
    assert lp.shape == new.shape
    return time.perf_counter() - t


def logprob_mismatch(model, prompts, gens, batch: int = 8) -> np.ndarray:
    diffs = []
    for i in range(0, len(gens), batch):
        chunk = list(zip(prompts[i : i + batch], gens[i : i + batch], strict=True))
        ids = torch.tensor([p + g.output_ids.tolist() for p, g in chunk], device=DEVICE)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        for row, (p, g) in enumerate(chunk):
            out = torch.tensor(g.output_ids, device=DEVICE)
            ref = torch.log_softmax(logits[row, len(p) - 1 : -1].float(), -1).gather(1, out[:, None])[:, 0]
            diffs.append(np.abs(ref.cpu().numpy() - g.logprobs))
        del logits
    return np.concatenate(diffs)


def roofline(cfg: ModelConfig, model, batch: int, prompt: int, new_tokens: int, tbps: float) -> tuple[float, float]:
    """tok/s bounds: (reading the weights + the KV actually in use, reading the whole static cache)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_heads
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * head_dim * 2  # K and V, bf16
    mean_context = prompt + new_tokens / 2
    used = weight_bytes + batch * mean_context * kv_per_token
    static = weight_bytes + batch * (prompt + new_tokens) * kv_per_token
    return batch * tbps * 1e12 / used, batch * tbps * 1e12 / static


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--hf-new-tokens", type=int, default=512, help="HF generate's length (lower it to save time)")
    ap.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth; default from the GPU name")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly (to see what the graphs buy)")
    ap.add_argument("--no-pipeline", action="store_true", help="read each step's tokens before the next decode")
    ap.add_argument("--hf-attention", action="store_true", help="decode with HF's sdpa (repeat_kv) attention")
    ap.add_argument("--engine-only", action="store_true", help="skip HF generate and the logprob checks")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny fp32 model on CPU: checks the script runs")
    args = ap.parse_args()
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
        base = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_engine needs a CUDA GPU (or --cpu-smoke)")
    else:
        base = QWEN3_0_3B
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    tbps = args.hbm_tbps or next((v for k, v in HBM_TBPS.items() if k in name), 3.35)
    cfg = dataclasses.replace(base, max_seq_len=args.prompt + args.new_tokens + 8)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), generator=g).tolist()

    engine, gens, eng_s = bench_engine(
        cfg,
        prompts,
        args.new_tokens,
        graphs=not args.no_graphs,
        pipeline=not args.no_pipeline,
        gqa_decode=not args.hf_attention,
    )
    model = engine.model
    graph_steps, steps = engine.stats["graph_steps"], engine.stats["steps"]
    n_params = sum(p.numel() for p in model.parameters())
    eng_tps = args.batch * args.new_tokens / eng_s
    assert all(len(x.output_ids) == args.new_tokens for x in gens)
    step_ms = 1e3 * eng_s / args.new_tokens  # the timed run's steps, its one prefill included
    attn = model.config._attn_implementation
    print(
        f"engine: {eng_s:.2f} s, {eng_tps:,.0f} tok/s, {step_ms:.2f} ms per decode step (prefill included); "
        f"attention {attn!r}, pipeline {'off' if args.no_pipeline else 'on'}, graph steps {graph_steps}/{steps}",
        flush=True,
    )
    if args.engine_only:
        engine.close()
        return
    same = logprob_mismatch(model, prompts, gens)
    engine.close()
    hf_s = bench_hf(model, prompts, args.hf_new_tokens)
    hf_tps = args.batch * args.hf_new_tokens / hf_s
    fp32 = copy.deepcopy(model).float()
    f32 = logprob_mismatch(fp32, prompts, gens)
    del fp32
    used, static = roofline(cfg, model, args.batch, args.prompt, args.new_tokens, tbps)

    q = lambda a, p: float(np.percentile(a, p))
    print(
        f"device: {name}; torch {torch.__version__}; model: qwen3 random init, {n_params / 1e6:.0f}M params, "
        f"{cfg.dtype}"
    )
    print(
        f"batch {args.batch}, prompt {args.prompt}, new tokens {args.new_tokens} (HF: {args.hf_new_tokens}), "
        f"logprobs on; decode steps replayed from a CUDA graph: {graph_steps}/{steps}"
    )
    print(f"{'':34}{'seconds':>10}{'tok/s':>12}")
    print(f"{'engine (prefill + decode)':34}{eng_s:>10.2f}{eng_tps:>12,.0f}")
    print(f"{'HF generate (same model, device)':34}{hf_s:>10.2f}{hf_tps:>12,.0f}")
    print(f"engine / HF: {eng_tps / hf_tps:.1f}x")
    print(
        f"roofline at {tbps} TB/s: {used:,.0f} tok/s reading weights + KV in use; "
        f"{static:,.0f} tok/s reading the whole static cache; engine at {eng_tps / static:.0%} of the latter"
    )
    print(f"{'|engine logprob - full forward|':34}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for label, d in ((f"vs {cfg.dtype} forward (same model)", same), ("vs fp32 forward (same weights)", f32)):
        print(f"{label:34}{d.mean():>10.4f}{q(d, 50):>10.4f}{q(d, 90):>10.4f}{q(d, 99):>10.4f}{d.max():>10.4f}")


if __name__ == "__main__":
    main()
