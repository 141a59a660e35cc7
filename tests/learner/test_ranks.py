"""A learner of several ranks on CPU: rank 0 leads (`LeaderBackend`), rank 1 follows its calls
(`follow`), both over gloo in separate processes; the torch backend is data-parallel across them,
the ranks sharing the π_prox pass and each mini-batch update of the RL step (four per batch).

The two-rank learner must take exactly the step one rank takes on the whole batch (same weights to
float tolerance, same loss, kept-token count and grad norm), its replicas must stay equal, and a
checkpoint it writes must restore. The same rank machinery carries megatron's TP x DP ranks on GPUs
(measured with configs/four_gpu.yaml, docs/BENCHMARKS.md); `kiln train` with two CPU ranks, and a
rank killed mid-run, is in tests/launch/driver/test_train.py.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from actors.learner.ranks import RankSpec
from configs import AlgoConfig, LearnerConfig, ModelConfig
from protocols import TrainBatch
from tests.helpers.common import free_port

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=259)
T = 0.7
# Small micro-batches so the batch splits into several and each rank gets a different share.
LEARNER = LearnerConfig(lr=1e-2, micro_batch_tokens=24)
ALGO = AlgoConfig(mirrorpop_delta=0.15, ppo_minibatches=4)


def batch(seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    lengths, prompts = [9, 14, 7, 11, 16, 5], [3, 5, 2, 4, 6, 1]
    n = sum(lengths)
    mask = np.concatenate([np.arange(length) >= p for length, p in zip(lengths, prompts, strict=True)])
    return TrainBatch(
        version=0,
        episode_ids=[f"ep{i}" for i in range(len(lengths))],
        tokens=rng.integers(0, TINY.vocab_size, n).astype(np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        loss_mask=mask,
        behaviour_logprobs=np.zeros(n, np.float32),
        advantages=rng.normal(size=len(lengths)).astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int64),
    )


def on_policy(backend, b: TrainBatch, noise: float) -> TrainBatch:
    """μ = the current logprobs, shifted by `noise` on every other sequence (MirrorPop drops those when
    noise > δ) plus a small per-token wobble (so the clip has work)."""
    lp = backend.logprobs(b, T).numpy()
    seq = np.repeat(np.arange(len(b.advantages)), np.diff(b.cu_seqlens))
    lp = lp + noise * (seq % 2) + 0.05 * np.sin(np.arange(len(lp)))
    return dataclasses.replace(b, behaviour_logprobs=np.where(b.loss_mask, lp, 0).astype(np.float32))


def script(backend, out: Path | None) -> dict:
    """What both runs do: an SFT step at its own lr, two RL steps, logprobs, a checkpoint and restore."""
    results = {"sft": backend.sft_step(batch(1), lr=5e-3)}
    b = on_policy(backend, batch(2), 0.0)
    results["rl1"] = backend.train_step(b)
    results["rl2"] = backend.train_step(on_policy(backend, batch(3), 0.3))
    results["logprobs"] = backend.logprobs(batch(4), T)
    if out is not None:
        backend.save_checkpoint(out / "ckpt")
        backend.train_step(b)  # moves the weights; the restore below must bring them back
        backend.load_checkpoint(out / "ckpt")
    results["weights"] = {n: t.detach().clone() for n, t in backend.named_weights()}
    return results


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from actors.learner.algorithm import Trainer
    from actors.learner.ranks import LeaderBackend, follow, host_rendezvous, join
    from actors.learner.torch_backend import TorchBackend

    torch.set_num_threads(1)
    store = host_rendezvous("127.0.0.1", world, port) if rank == 0 else None
    channel = join(RankSpec(rank, world, f"127.0.0.1:{port}"), "cpu", store)
    local = Trainer(TorchBackend(TINY, LEARNER), ALGO, temperature=T)
    if rank == 0:
        leader = LeaderBackend(local, channel)
        results = script(leader, Path(out))
        assert leader.stop_followers()
    else:
        follow(local, channel)
        results = {"weights": {n: t.detach().clone() for n, t in local.named_weights()}}
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    mp.start_processes(_rank, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn", join=True)
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]


@pytest.fixture(scope="module")
def one_rank():
    from actors.learner.algorithm import Trainer
    from actors.learner.torch_backend import TorchBackend

    torch.set_num_threads(1)
    return script(Trainer(TorchBackend(TINY, LEARNER), ALGO, temperature=T), None)


def test_two_data_parallel_ranks_take_the_one_rank_step(two_ranks, one_rank):
    led = two_ranks[0]
    for step in ("sft", "rl1", "rl2"):
        a, b = led[step], one_rank[step]
        assert a.trained_tokens == b.trained_tokens and a.tokens == b.tokens
        assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-7)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
        for key in a.metrics.keys() - {"skipped"} if step != "sft" else []:
            assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-5, abs=1e-7), key
    # the second RL batch is far enough off-policy that MirrorPop drops some sequences on both
    assert 0 < led["rl2"].metrics["kept_fraction"] < 1
    torch.testing.assert_close(led["logprobs"], one_rank["logprobs"], rtol=1e-5, atol=1e-6)
    # rank 0 saved, stepped again and restored: it must hold the one-rank run's weights. Nine Adam updates
    # (SFT + 2 batches x 4) lie behind them, and Adam divides each gradient by its own running RMS, so on
    # near-zero gradients the ranks' different summation order shows up as ~1e-6 in the weights.
    for name, t in one_rank["weights"].items():
        torch.testing.assert_close(led["weights"][name], t, rtol=1e-5, atol=1e-5)


def test_replicas_stay_equal(two_ranks):
    leader, follower = two_ranks
    for name, t in leader["weights"].items():
        assert torch.equal(follower["weights"][name], t), name


def test_rank_specs_are_checked():
    with pytest.raises(ValueError, match="outside a world of 2"):
        RankSpec(2, 2, "127.0.0.1:1234")
    with pytest.raises(ValueError, match="host:port"):
        RankSpec(0, 2, "localhost")
