"""Synthetic, fully valid `Episode` records for driving the replay without engines or verifiers: the
staleness simulation, the ack-latency benchmark and the tests build their episodes here.

Scores follow the MooreEval hierarchy (docs/verifier.md): a pass scores >= 1 with q = 1; a failure
scores in [-1, -0.5) with q = 2s + 1 clipped to [0, 1]; an infra failure is the system's fault.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np

from protocols import Episode, Task, Turn, VerifyResult


def verdict(passed: bool, score: float, *, infra: bool = False, feedback: str = "") -> VerifyResult:
    if infra:
        return VerifyResult(
            request_id=uuid.uuid4().hex,
            task_id="",
            passed=False,
            stage="run",
            error_class="infra",
            q=0.0,
            score=score,
            feedback=feedback or "verifier unavailable",
        )
    if passed:
        return VerifyResult(
            request_id=uuid.uuid4().hex,
            task_id="",
            passed=True,
            stage="done",
            error_class=None,
            q=1.0,
            score=score,
            feedback=feedback or "correct",
        )
    return VerifyResult(
        request_id=uuid.uuid4().hex,
        task_id="",
        passed=False,
        stage="correctness",
        error_class="correctness",
        q=float(np.clip(2 * score + 1, 0.0, 1.0)),
        score=score,
        feedback=feedback or f"wrong output (score {score:g})",
    )


@dataclass
class TurnSpec:
    """What a synthetic turn should look like."""

    passed: bool = False
    score: float = -1.0
    version: int = 0  # weight version of every response token, unless `versions` is given
    versions: list[int] | None = None
    prompt_len: int = 6
    response_len: int = 5
    text: str = ""
    feedback: str = ""
    infra: bool = False
    verified: bool = True  # False leaves Turn.result empty (also an infra failure)


def make_turn(spec: TurnSpec, rng: np.random.Generator | None = None) -> Turn:
    rng = rng or np.random.default_rng(0)
    versions = np.asarray(
        spec.versions if spec.versions is not None else [spec.version] * spec.response_len, dtype=np.int64
    )
    n = len(versions)
    return Turn(
        prompt_ids=rng.integers(0, 256, spec.prompt_len, dtype=np.int64),
        response_ids=rng.integers(0, 256, n, dtype=np.int64),
        logprobs=-rng.random(n, dtype=np.float32),
        versions=versions,
        finish_reason="stop",
        text=spec.text or f"candidate scoring {spec.score:g}",
        result=verdict(spec.passed, spec.score, infra=spec.infra, feedback=spec.feedback) if spec.verified else None,
    )


def make_episode(
    task: Task,
    group_id: str,
    sample_index: int,
    turns: list[TurnSpec],
    *,
    episode_id: str | None = None,
    rng: np.random.Generator | None = None,
) -> Episode:
    """One sample of a served group; `task` is the task exactly as served (repair context included)."""
    built = [make_turn(t, rng) for t in turns]
    return Episode(
        episode_id=episode_id or uuid.uuid4().hex,
        task=task,
        group_id=group_id,
        sample_index=sample_index,
        turns=built,
        rewards=[t.score for t in turns],
        is_retry=task.repair is not None,
        actor_id="synthetic",
    )
