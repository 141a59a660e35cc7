"""Episodes, turns and verdicts built by hand for the episode-dump and report tests, and the dumper they
feed."""

from __future__ import annotations

import numpy as np

from actors.policy.tokenizer import ByteTokenizer, Message
from configs import AlgoConfig
from launch.observe.episode_dump import EpisodeDumper
from protocols import Episode, KernelSpec, Task, Turn, VerifyResult

TOK = ByteTokenizer()


def _task(task_id="L1_relu", repair=None):
    spec = KernelSpec(name="relu", reference="class Model: ...", backend="cpu", level=1)
    return Task(task_id=task_id, kind="kernel", kernel=spec, repair=repair)


def _turn(prompt, response, result, version=3):
    ids = np.array(TOK.render([Message("user", prompt)]), dtype=np.int64)
    resp = np.array(TOK.encode(response), dtype=np.int64)
    return Turn(
        prompt_ids=ids,
        response_ids=resp,
        logprobs=np.zeros(len(resp), np.float32),
        versions=np.full(len(resp), version, np.int64),
        finish_reason="stop",
        text=response,
        result=result,
    )


def _result(passed, stage="done", error=None, q=1.0, score=1.0, eager=None, compile_=None, feedback="", **diag):
    return VerifyResult(
        request_id="r",
        task_id="L1_relu",
        passed=passed,
        stage=stage,
        error_class=error,
        q=q,
        score=score,
        speedup_eager=eager,
        speedup_compile=compile_,
        feedback=feedback,
        diagnostics=diag,
    )


def _episode(eid, rewards, turns, task=None, is_retry=False, group="g7"):
    return Episode(
        episode_id=eid,
        task=task or _task(),
        group_id=group,
        sample_index=int(eid[-1]),
        turns=turns,
        rewards=rewards,
        is_retry=is_retry,
        actor_id="rollout-1",
    )


def _dumper(tmp_path, per_step=4, **algo):
    return EpisodeDumper(tmp_path, AlgoConfig(**algo), TOK.decode, per_step=per_step)


def _failed(stage="compile", error="compile", feedback="error: expected ')' at line 1"):
    return _result(False, stage, error, 0.0, -1.0, feedback=feedback)
