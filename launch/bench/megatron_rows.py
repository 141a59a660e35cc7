"""What the megatron GPU check (launch/bench/gpu_megatron.py) and its throughput rows
(launch/bench/gpu_megatron_throughput.py) share: the two model shapes, the result rows and the `check`
decorator that turns one failing check into a FAIL row, the synthetic batches, and the placement
plan's memory estimate that the measured peaks are held against."""

from __future__ import annotations

import dataclasses
import gc
import traceback

import numpy as np
import torch
import torch.distributed as dist

from actors.learner.algorithm import Trainer
from actors.learner.megatron.backend import MegatronBackend
from configs import LearnerConfig, ModelConfig
from protocols import TrainBatch

H100_BF16_FLOPS = 989e12
T = 0.8
SMALL = ModelConfig(
    arch="qwen3",
    vocab_size=1000,
    hidden_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=512,
    max_seq_len=2048,
    dtype="bfloat16",
    seed=3,
)
LARGE = ModelConfig(
    arch="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=6144,
    max_seq_len=8192,
    dtype="bfloat16",
    seed=0,
)
ROWS: list[dict] = []


def rank0() -> bool:
    return dist.get_rank() == 0


def row(name: str, ok: bool | None, detail: str, **values) -> None:
    status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
    ROWS.append({"check": name, "status": status, "detail": detail, **values})
    if rank0():
        print(f"[gpu_check] {status:4s} {name}: {detail}", flush=True)


def check(name: str):
    """Run the decorated check at once; an exception becomes a FAIL row and the next check runs."""

    def run(fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - one failure must not hide the other rows
            row(name, False, f"{type(err).__name__}: {err}".splitlines()[0][:300])
            if rank0():
                traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
        return fn

    return run


def make_batch(cfg: ModelConfig, lengths: list[int], seed: int) -> TrainBatch:
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    mask = np.concatenate([np.arange(length) >= length // 5 for length in lengths])
    return TrainBatch(
        version=0,
        episode_ids=[f"s{i}" for i in range(len(lengths))],
        tokens=rng.integers(0, cfg.vocab_size, n).astype(np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.zeros(n, np.float32),
        advantages=rng.standard_normal(len(lengths)).astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int64),
    )


def with_behaviour(batch: TrainBatch, logprobs: np.ndarray, drifted: int | None, seed: int) -> TrainBatch:
    """μ = the given logprobs + small noise; sequence `drifted` gets noise far beyond MirrorPop's δ."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(0, 0.02, logprobs.shape)
    if drifted is not None:
        a, b = batch.cu_seqlens[drifted], batch.cu_seqlens[drifted + 1]
        noise[a:b] += 2.0
    mu = np.where(batch.loss_mask, logprobs + noise, 0).astype(np.float32)
    return dataclasses.replace(batch, behaviour_logprobs=mu)


def weights(backend: Trainer | MegatronBackend) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu() for n, t in backend.named_weights()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def plan_estimate(learner: LearnerConfig, *, tp: int, pp: int, dp: int, stage: int) -> float:
    """The placement plan's bytes for this pipeline stage of the LARGE model under `learner`."""
    from launch.driver.model_memory import megatron_stage_memory, model_shape

    stages = megatron_stage_memory(model_shape(LARGE), learner, tp=tp, pp=pp, dp=dp)
    return sum((stages[0] if stage == 0 else stages[-1]).values())
