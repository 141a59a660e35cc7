"""`kiln rft`'s sampling: each task's group of attempts through Kiln's own rollout code (the engine, the
turn policy and `GroupRunner`, as a rollout actor runs them, repair turns included), verified through a
verifier pool.

The verifier pool is a seam: anything with `verify_all(requests) -> results` (in order) and `close()`.
`LocalVerifierPool` runs the kernel verifier in this process over a thread pool (the verifier compiles
in its own build pool and runs candidates in its sandbox either way); a pool of verifier actors can take
its place without touching the sampling loop.

Forced-candidate mode (`forced`: a solutions directory) draws each attempt from the task's candidate
pool (actors/rollout/forced.py: the shipped solution and broken variants) and has the engine score it,
so passing attempts exist where a small model writes no kernel that compiles (CPU tests, the demo).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from actors.policy.tokenizer import load_tokenizer
from actors.rollout.engine import SamplingParams
from actors.rollout.engines import make_engine
from actors.rollout.episodes import GroupRunner
from actors.rollout.forced import CandidatePool
from actors.rollout.turns import TurnPolicy, TurnRules
from configs import EvalConfig, ModelConfig, RolloutConfig, VerifierConfig
from protocols import Episode, Task, TaskReply, VerifyRequest, VerifyResult


class VerifierPool(Protocol):
    def verify_all(self, requests: list[VerifyRequest]) -> list[VerifyResult]: ...

    def close(self) -> None: ...


class LocalVerifierPool:
    """The kernel verifier in this process; `verify_all` verifies up to `verifier.max_concurrent_requests` at once."""

    def __init__(self, cfg: VerifierConfig) -> None:
        from actors.verifier.verifier import KernelVerifier

        self.verifier = KernelVerifier(cfg)
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrent_requests, thread_name_prefix="kiln-rft-verify")

    def verify_all(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return list(self._pool.map(self.verifier.verify, requests))  # verify() answers every request

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.verifier.close()


def sample_groups(
    tasks: list[Task],
    *,
    rollout: RolloutConfig,
    model: ModelConfig,
    evaluation: EvalConfig,
    samples: int,
    verifier: VerifierPool,
    forced: Path | None = None,
) -> Iterator[tuple[Task, list[Episode]]]:
    """Each task's `samples` attempts (with their repair turns, up to `rollout.max_turns`), in task order."""
    tokenizer = load_tokenizer(model)
    stops = tokenizer.stop_ids
    params = SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=tuple(stops),
    )
    pool = CandidatePool(forced, seed=rollout.seed) if forced is not None else None
    engine = make_engine(rollout, model, index=0, eos_token_ids=stops)
    try:
        runner = GroupRunner(
            actor_id="rft",
            generate=engine.generate,
            verifier=verifier,
            tokenizer=tokenizer,
            params=params,
            policy=TurnPolicy(TurnRules.from_config(rollout, model, evaluation), tokenizer),
            force=pool.draw if pool is not None else None,
        )
        for i, task in enumerate(tasks):
            yield task, runner.run(TaskReply(status="task", task=task, group_id=f"rft-{i}", group_size=samples))
    finally:
        engine.close()
