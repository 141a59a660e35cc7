"""What the weight-sync tests share: a tiny model, rollout actors whose registry holds only the
learner (they generate on request), a forced response to score, the learner's own logprobs of it,
and a gloo `WeightServer` serving a first version."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from actors.base import RunContext
from actors.learner.weight_sync import WeightServer
from actors.policy.model import build_model
from actors.rollout.actor import RolloutActor
from actors.rollout.engine import GenerateRequest, SamplingParams
from configs import EvalConfig, ModelConfig, RolloutConfig
from protocols.registry import Registry

TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=256)
NOWHERE = "tcp://127.0.0.1:9"  # a verifier nobody serves: these engines only generate on request
PROMPT = [256, 72, 101, 108, 108, 111, 32]
RESPONSE = [119, 111, 114, 108, 100, 33, 10, 65, 66]
T = 0.7


def rollout_cfg(**kw) -> RolloutConfig:
    return RolloutConfig(
        **{
            "max_new_tokens": 8,
            "max_turns": 1,
            "max_batch": 4,
            "temperature": T,
            "device": "cpu",
            "task_wait_s": 0.5,
            **kw,
        }
    )


def register_learner(run_dir, endpoints) -> RunContext:
    """A run in `run_dir` whose registry holds the learner's weight endpoints and a verifier nobody serves
    (and no replay: these engines only generate on request)."""
    registry = Registry(run_dir)
    registry.register("learner", "learner", endpoints)
    registry.register("verifier-0", "verifier", {"verifier": NOWHERE})
    return RunContext(run_dir=str(run_dir))


def rollout_actor(run_dir, endpoints, actor_id: str, **kw) -> RolloutActor:
    ctx = dataclasses.replace(register_learner(run_dir, endpoints), name=actor_id)
    return RolloutActor(rollout_cfg(**kw), TINY, EvalConfig(), ctx)


def forced(prompt=PROMPT, response=RESPONSE) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            "score",
            list(prompt),
            SamplingParams(temperature=T, max_new_tokens=len(response)),
            forced_response=list(response),
        )
    ]


def learner_logprobs(model, prompt=PROMPT, response=RESPONSE) -> np.ndarray:
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / T, -1).gather(1, torch.tensor(response)[:, None])[:, 0].numpy()


def assert_serves(engine, model) -> None:
    """`engine` (a rollout actor or an engine) scores the forced response as `model` does: it serves
    exactly the learner's weights."""
    (gen,) = engine.generate(forced())
    assert np.abs(gen.logprobs - learner_logprobs(model)).max() <= 1e-5


def train_a_little(model, steps=3, seed=0) -> None:
    """A few optimizer steps on random tokens: the learner's weights move away from the engines'."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def tiny_model(seed: int):
    return build_model(dataclasses.replace(TINY, seed=seed))


@contextlib.contextmanager
def serving(run_dir, model, version: int = 1, **kw) -> Iterator[tuple[WeightServer, dict[str, str]]]:
    """A learner's gloo `WeightServer` in `run_dir` that has published `model` as `version`: (server, its
    endpoints); stopped at the end. `kw` overrides its settings (small buckets, a 30 s push timeout)."""
    server = WeightServer(run_dir, **{"transport": "gloo", "bucket_mb": 0.05, "timeout_s": 30, **kw})
    try:
        endpoints = server.start()
        server.publish(version, model.named_parameters)
        yield server, endpoints
    finally:
        server.stop()
