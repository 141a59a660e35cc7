"""Benchmark of the torch learner's attention: one RL step on the same batch and weights with the
packed attention (actors/policy/packed_attention.py) and with transformers' sdpa and its T x T block
mask, the two sides alternating in one process.

    python -m launch.bench.learner_attention [--config configs/examples/repair_text.yaml]
        [--sequences 64] [--lengths 150,256] [--prompt 100] [--rounds 3] [--device cpu]

The batch: `--sequences` sequences of lengths drawn uniformly from [a, b), the first `--prompt`
tokens of each without gradient, random tokens and advantages (the time does not depend on them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from configs import ConfigError, load_config
from protocols import TrainBatch


def batch_of(sequences: int, low: int, high: int, prompt: int, vocab: int, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high, sequences)
    n = int(lengths.sum())
    mask = np.concatenate([np.arange(length) >= prompt for length in lengths])
    return TrainBatch(
        version=0,
        episode_ids=[f"e{i}" for i in range(sequences)],
        tokens=rng.integers(0, vocab, n).astype(np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.zeros(n, np.float32),
        advantages=rng.standard_normal(sequences).astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int64),
    )


def main(argv: list[str] | None = None) -> int:
    from actors.learner.algorithm import Trainer
    from actors.learner.torch_backend import TorchBackend

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/examples/repair_text.yaml")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--lengths", default="150,256", help="sequence lengths drawn from [a, b)")
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        low, high = (int(x) for x in args.lengths.split(","))
        cfg = load_config(args.config, [])
    except (ValueError, ConfigError) as err:
        p.error(str(err))
    if not 0 < low < high <= cfg.model.max_seq_len or args.sequences < 1 or args.rounds < 1:
        p.error(
            f"--lengths needs 0 < a < b <= model.max_seq_len ({cfg.model.max_seq_len}), --sequences and --rounds >= 1"
        )
    if args.device == "cpu":
        torch.set_num_threads(1)
    batch = batch_of(args.sequences, low, high, args.prompt, cfg.model.vocab_size)
    sides = {
        name: Trainer(
            TorchBackend(cfg.model, cfg.learner, device=args.device, packed=packed),
            cfg.algo,
            temperature=cfg.rollout.temperature,
        )
        for name, packed in (("block mask (sdpa)", False), ("packed", True))
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, trainer in sides.items():
            started = time.perf_counter()
            trainer.train_step(batch)
            if args.device != "cpu":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - started)
    tokens = len(batch.tokens)
    print(f"{args.sequences} sequences, {tokens} tokens, micro_batch_tokens {cfg.learner.micro_batch_tokens}")
    print("| attention | steps (s) | median (s) | tokens/s |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {' '.join(f'{t:.2f}' for t in ts)} | {med:.2f} | {tokens / med:,.0f} |")
    ratio = statistics.median(times["block mask (sdpa)"]) / statistics.median(times["packed"])
    print(f"packed is {ratio:.1f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
