"""Evaluation attempts: first-turn answers sampled from the policy with the evaluation's sampling
settings, verified, and kept as one `EvalAttempt` record each.

This is the one evaluation path of Kiln: `kiln train`'s in-run validation (`RolloutActor.evaluate`)
and `kiln eval` (launch/stages/eval/) both pose a task with the turn policy's first prompt, sample through
an engine with `eval_params(...)`, split the answer from the thinking, verify it with the training
verifier, and turn each verdict into an `EvalAttempt` with `attempt_from_result`. The metrics and
the table are computed from these records by launch/stages/eval/metrics.py and launch/stages/eval/table.py.

Forced candidates (`rollout.forced_candidates`) never reach this code: `first_turn_answers` has no
forced-response input, so an evaluation always measures what the policy itself writes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from actors.rollout.engine import GenerateRequest, Generation, SamplingParams
from actors.rollout.turns import Attempt, Done, TurnPolicy
from configs import EvalConfig, RolloutConfig
from protocols import Task, VerifyRequest, VerifyResult, infra_result


@dataclass(frozen=True)
class EvalAttempt:
    """One verified attempt of an evaluation (a line of `attempts.jsonl`)."""

    task_id: str  # "level1/01_relu"
    level: int  # the task's KernelBench level (0 when its path names none)
    sample: int  # index among the task's n samples
    text: str  # the answer that was verified (model output after any thinking)
    passed: bool  # extracted, compiled, correct on every trial and legal
    stage: str  # the verifier stage reached (VerifyResult.stage)
    error_class: str | None  # None when passed; "infra" when the system, not the answer, failed
    speedup_eager: float | None  # eager time / kernel time, when measured
    speedup_compile: float | None  # torch.compile time / kernel time, when measured
    feedback: str = ""  # the verifier's first feedback line
    finish_reason: str = ""  # "stop", "length", "abort"; "" for answers produced elsewhere

    @property
    def infra(self) -> bool:
        return self.error_class == "infra"

    @property
    def key(self) -> tuple[str, int]:
        return self.task_id, self.sample

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict) -> EvalAttempt:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__ if name in row})


def attempt_from_result(
    task: Task, sample: int, text: str, result: VerifyResult, *, finish_reason: str = ""
) -> EvalAttempt:
    lines = result.feedback.strip().splitlines()
    return EvalAttempt(
        task_id=task.task_id,
        level=task.kernel.level if task.kernel else 0,
        sample=sample,
        text=text,
        passed=result.passed,
        stage=result.stage,
        error_class=result.error_class,
        speedup_eager=result.speedup_eager,
        speedup_compile=result.speedup_compile,
        feedback=lines[0][:300] if lines else "",
        finish_reason=finish_reason,
    )


def eval_params(evaluation: EvalConfig, rollout: RolloutConfig, stop_ids: list[int]) -> SamplingParams:
    """The evaluation's sampling settings (eval.*, the model card's quickstart by default), never
    training's: the temperature and top-p a policy is judged at are not the ones it explores at."""
    return SamplingParams(
        temperature=evaluation.temperature,
        top_p=evaluation.top_p,
        max_new_tokens=eval_max_new_tokens(evaluation, rollout),
        stop_token_ids=tuple(stop_ids),
    )


def eval_max_new_tokens(evaluation: EvalConfig, rollout: RolloutConfig) -> int:
    return evaluation.max_new_tokens or rollout.max_new_tokens


@dataclass(frozen=True)
class Answer:
    """A sampled first-turn answer, or why the task could not be posed (`unposable`)."""

    task: Task
    sample: int
    text: str = ""
    finish_reason: str = ""
    unposable: str = ""  # the turn policy's reason when the prompt does not fit the model


def first_turn_answers(
    pairs: list[tuple[Task, int]],
    *,
    generate: Callable[[list[GenerateRequest]], list[Generation]],
    tokenizer,
    policy: TurnPolicy,
    params: SamplingParams,
) -> list[Answer]:
    """One sampled answer per (task, sample index), all generated in one engine call."""
    answers: list[Answer | None] = [None] * len(pairs)
    requests, where = [], []
    for i, (task, sample) in enumerate(pairs):
        prompt = policy.next_prompt(Attempt.of(task), None)
        if isinstance(prompt, Done):
            answers[i] = Answer(task=task, sample=sample, unposable=prompt.detail or prompt.reason)
            continue
        requests.append(
            GenerateRequest(
                request_id=f"eval/{task.task_id}/{sample}/{uuid.uuid4().hex[:8]}",
                prompt_ids=list(prompt.ids),
                params=params,
            )
        )
        where.append(i)
    for i, gen in zip(where, generate(requests) if requests else [], strict=True):
        task, sample = pairs[i]
        answers[i] = Answer(
            task=task,
            sample=sample,
            text=tokenizer.split_response(gen.output_ids).answer,
            finish_reason=gen.finish_reason,
        )
    return answers  # type: ignore[return-value]


def verify_requests(answers: list[Answer]) -> list[VerifyRequest]:
    return [
        VerifyRequest(
            request_id=f"eval/{a.task.task_id}/{a.sample}/{uuid.uuid4().hex[:8]}",
            task=a.task,
            candidate=a.text,
            episode_id=f"eval/{a.task.task_id}/{a.sample}",
            turn=0,
        )
        for a in answers
    ]


def verified_attempts(
    answers: list[Answer], verify_batch: Callable[[list[VerifyRequest]], list[VerifyResult]]
) -> list[EvalAttempt]:
    """Verify the posable answers in one batch; an unposable one is recorded as infra (the system's
    limits, not the policy's answer), so it is excluded from the metrics and counted."""
    posable = [a for a in answers if not a.unposable]
    requests = verify_requests(posable)
    results = dict(zip((id(a) for a in posable), verify_batch(requests) if requests else [], strict=True))
    out = []
    for a in answers:
        if a.unposable:
            request = VerifyRequest(request_id=f"eval/{a.task.task_id}/{a.sample}", task=a.task, candidate="")
            result = infra_result(request, f"cannot pose the task: {a.unposable}")
        else:
            result = results[id(a)]
        out.append(attempt_from_result(a.task, a.sample, a.text, result, finish_reason=a.finish_reason))
    return out
