"""The learner's steps reach the engines exactly (issue 6's CPU check): the torch backend takes a few
real off-policy steps on a batch made from the engine's own behaviour logprobs, pushes the weights over
gloo to an engine in another process (a Ray actor), and the engine's logprobs on a fixed prompt then
equal the learner's own forward; before any step, the engine's μ equals the learner's π_prox at a
temperature other than 1."""

from __future__ import annotations

import numpy as np

from actors.base import RunContext, as_ray_actor
from actors.learner.algorithm import Trainer
from actors.learner.torch_backend import TorchBackend
from actors.learner.weight_sync import WeightServer
from actors.rollout.actor import RolloutActor
from actors.rollout.engine import GenerateRequest, SamplingParams
from configs import AlgoConfig, EvalConfig, LearnerConfig, ModelConfig, RolloutConfig
from protocols import TrainBatch
from protocols.registry import Registry

TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=256)
T = 0.7
PROMPT = [256, 75, 105, 108, 110, 58, 32]
GOOD = [107, 101, 114, 110, 101, 108, 10]
BAD = [120, 120, 120, 120, 120, 120, 10]


def score(ray, actor, response):
    req = GenerateRequest(
        "s", list(PROMPT), SamplingParams(temperature=T, max_new_tokens=len(response)), forced_response=list(response)
    )
    (gen,) = ray.get(actor.generate.remote([req]))
    return gen


def batch_from(gens, advantages) -> TrainBatch:
    tokens, mask, mu, versions, lengths = [], [], [], [], []
    for gen in gens:
        resp = gen.output_ids.tolist()
        tokens += PROMPT + resp
        mask += [False] * len(PROMPT) + [True] * len(resp)
        mu += [0.0] * len(PROMPT) + gen.logprobs.tolist()
        versions += [-1] * len(PROMPT) + gen.versions.tolist()
        lengths.append(len(PROMPT) + len(resp))
    return TrainBatch(
        version=0,
        episode_ids=[f"e{i}" for i in range(len(gens))],
        tokens=np.asarray(tokens, np.int64),
        cu_seqlens=np.cumsum([0] + lengths).astype(np.int64),
        loss_mask=np.asarray(mask),
        behaviour_logprobs=np.asarray(mu, np.float32),
        advantages=np.asarray(advantages, np.float32),
        versions=np.asarray(versions, np.int64),
    )


def response_logprobs(backend: Trainer, batch: TrainBatch) -> np.ndarray:
    return backend.logprobs(batch, T).numpy()[batch.loss_mask]


def test_torch_backend_steps_pushed_over_gloo_match_the_engine(tmp_path, ray_session):
    ray = ray_session
    backend = Trainer(
        TorchBackend(TINY, LearnerConfig(lr=3e-3, micro_batch_tokens=64), device="cpu"),
        AlgoConfig(mirrorpop_delta=1.0),
        temperature=T,
    )
    server = WeightServer(tmp_path, transport="gloo", bucket_mb=0.05, timeout_s=30, join_timeout_s=20)
    endpoints = server.start()
    rollout = RolloutConfig(max_new_tokens=8, max_turns=1, max_batch=4, temperature=T, device="cpu")
    registry = Registry(
        tmp_path
    )  # the engine finds the learner's weights here (and no replay: it generates on request)
    registry.register("learner", "learner", endpoints)
    registry.register("verifier-0", "verifier", {"verifier": "tcp://127.0.0.1:9"})
    engine = as_ray_actor(RolloutActor, num_cpus=0).remote(
        rollout, TINY, EvalConfig(), RunContext(run_dir=str(tmp_path), name="engine")
    )
    try:
        ray.get(engine.start.remote(), timeout=120)
        gens = [score(ray, engine, GOOD), score(ray, engine, BAD)]
        batch = batch_from(gens, [1.0, -1.0])
        # μ from the engine equals the learner's π_prox on the same tokens, at T = 0.7
        assert np.abs(response_logprobs(backend, batch) - batch.behaviour_logprobs[batch.loss_mask]).max() <= 1e-5

        results = [backend.train_step(batch) for _ in range(3)]
        assert results[0].metrics["kept_fraction"] == 1.0  # on-policy at first: MirrorPop keeps all
        learner_after = response_logprobs(backend, batch)
        assert learner_after[: len(GOOD)].sum() > batch.behaviour_logprobs[batch.loss_mask][: len(GOOD)].sum()

        server.publish(1, backend.named_weights)
        assert server.wait_confirmed(1, ["engine"], timeout_s=30), server.health()
        pushed = [score(ray, engine, GOOD), score(ray, engine, BAD)]
        engine_after = np.concatenate([g.logprobs for g in pushed])
        assert all(g.versions.tolist() == [1] * len(g.versions) for g in pushed)
        assert np.abs(engine_after - learner_after).max() <= 1e-5  # the engine serves the learner's weights
        assert np.abs(engine_after - batch.behaviour_logprobs[batch.loss_mask]).max() > 1e-3  # and they moved
    finally:
        ray.kill(engine)
        server.stop()
