"""The torch engine's admission, before and after insertion: tokens/s of a stream of requests with
varied lengths, so rows finish and new ones are admitted every few steps (what the per-attempt
rollout pipeline does to the engine). The same requests, seed and threads run through the engine
rebuilding its whole batch on every admission (`insert=False`, the engine before) and admitting
into finished rows' slots (`insert=True`), side by side in one process.

    python -m launch.bench.admission [--requests 96] [--max-batch 16] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from actors.rollout.engine import GenerateRequest, SamplingParams
from actors.rollout.torch_engine import TorchEngine
from configs import ModelConfig


def workload(n: int, seed: int) -> list[GenerateRequest]:
    """Prompts of 16-64 tokens; 80% of responses at 8-32 tokens and 20% at 96-128, EOS ignored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 256, (int(torch.randint(16, 65, (1,), generator=g)),), generator=g).tolist()
        long = torch.rand(1, generator=g).item() < 0.2
        new = int(torch.randint(96, 129, (1,), generator=g)) if long else int(torch.randint(8, 33, (1,), generator=g))
        out.append(GenerateRequest(str(i), prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)))
    return out


def run(model: ModelConfig, reqs: list[GenerateRequest], *, insert: bool, max_batch: int, device: str) -> dict:
    engine = TorchEngine(model, max_batch=max_batch, device=device, insert=insert, seed=0)
    try:
        engine.generate(reqs[:2])  # warm-up
        before = dict(engine.stats)
        started = time.perf_counter()
        futures = [engine.submit(r) for r in reqs]  # all at once: the engine admits as rows finish
        tokens = sum(len(f.result().output_ids) for f in futures)
        seconds = time.perf_counter() - started
        return {
            "tokens": tokens,
            "seconds": seconds,
            "tok_s": tokens / seconds,
            "rebuilds": engine.stats["rebuilds"] - before["rebuilds"],
            "inserted": engine.stats["inserted"] - before["inserted"],
        }
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=256, help="hidden size of the random-init model")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = ModelConfig(
        num_layers=4,
        hidden_size=a.width,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=4 * a.width,
        max_seq_len=512,
        vocab_size=259,
    )
    reqs = workload(a.requests, seed=0)
    print("| admission | tokens | seconds | tok/s | rebuilds | inserted |")
    print("| --- | --- | --- | --- | --- | --- |")
    results = {}
    for insert in (False, True):
        r = results[insert] = run(model, reqs, insert=insert, max_batch=a.max_batch, device=a.device)
        name = "insert (prefill new rows only)" if insert else "rebuild (re-prefill the batch)"
        print(f"| {name} | {r['tokens']} | {r['seconds']:.2f} | {r['tok_s']:.0f} | {r['rebuilds']} | {r['inserted']} |")
    print(f"insert / rebuild: {results[True]['tok_s'] / results[False]['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
