"""One evaluation, start to finish: load what is left to do from the attempt log, produce answers
(sampled from a model, or read from an answer set), verify them in batches, append each verified
attempt to the log, and write the outputs from every attempt in the log.

Timing holds the GPU exclusively: the verifier times under the exclusive device lease, and while
a batch is being verified the evaluation's own engine is idle (answers for the next batch are
sampled only after it) and paused, so an engine that shares the GPU never decodes during a timing
window.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from actors.rollout.evaluation import Answer, EvalAttempt, first_turn_answers, verified_attempts
from configs import KilnConfig
from launch.stages.eval import table
from launch.stages.eval.attempt_log import AttemptLog
from launch.stages.eval.environment import device_name, toolchain, verifier_settings
from launch.stages.eval.metrics import summarize
from launch.stages.eval.progress import Progress
from launch.stages.eval.sources import TaskSet
from launch.stages.eval.verifiers import RemoteVerifierSet, VerifierSet, verify_batch
from protocols import Task

log = logging.getLogger(__name__)

ATTEMPTS, SUMMARY, TABLE, CHART, SETTINGS = "attempts.jsonl", "summary.json", "table.md", "chart.png", "settings.json"


class EvalError(ValueError):
    """An evaluation that cannot run as asked (one line for the user)."""


@dataclass
class EvalPlan:
    name: str  # the table row's label
    mode: str  # "model" or "answers"
    source: str  # the model directory / engine URLs, or the answers file
    task_set: TaskSet
    ks: tuple[int, ...]
    samples: int  # n per task (model mode; an answer set has what it has)
    out: Path
    cfg: KilnConfig  # verifier, rollout, model and eval sections as resolved for this evaluation
    use_ray: bool = False
    answers: list | None = None  # AnswerRecords (answers mode)
    rejected_answers: list[str] = dataclasses.field(default_factory=list)
    sampling: dict | None = None  # the sampling settings (model mode)

    def settings(self) -> dict:
        """What an interrupted evaluation must share with the one that resumes it."""
        return {
            "mode": self.mode,
            "source": self.source,
            "tasks": [t.task_id for t in self.task_set.tasks],
            "samples": self.samples if self.mode == "model" else None,
            "sampling": self.sampling,
            "verifier": verifier_settings(self.cfg.verifier),
        }


def run_evaluation(plan: EvalPlan, *, progress_stream=None) -> dict:
    plan.out.mkdir(parents=True, exist_ok=True)
    _check_resumable(plan)
    attempt_log = AttemptLog(plan.out / ATTEMPTS)
    started = time.monotonic()
    resumed = len(attempt_log.done)
    try:
        pending = _pending(plan, attempt_log)
        total = resumed + sum(len(v) for v in pending.values())
        progress = Progress(len(_evaluated(plan)), total, resumed, stream=progress_stream)
        verified = 0
        if pending:
            verifiers = (
                RemoteVerifierSet(plan.cfg.verifier, plan.cfg.rollout)
                if plan.cfg.verifier.remote
                else VerifierSet(
                    plan.cfg.verifier,
                    plan.cfg.rollout,
                    plan.out / "actors",
                    use_ray=plan.use_ray,
                    gpu_share=0.5 if _engine_on_ray_gpu(plan) else 1.0,
                )
            )
            try:
                verified = _produce(plan, pending, attempt_log, verifiers, progress)
            finally:
                verifiers.close()
        progress.finish()
    finally:
        attempt_log.close()
    return write_outputs(
        plan, list(attempt_log.done.values()), resumed=resumed, verified=verified, seconds=time.monotonic() - started
    )


def _check_resumable(plan: EvalPlan) -> None:
    path = plan.out / SETTINGS
    settings = plan.settings()
    if path.exists():
        try:
            before = json.loads(path.read_text())
        except ValueError:
            before = None
        if before != json.loads(json.dumps(settings)):
            diff = [k for k in settings if before is None or before.get(k) != json.loads(json.dumps(settings[k]))]
            raise EvalError(
                f"{plan.out} holds an evaluation with other settings ({', '.join(diff)} differ); "
                "give another --out to start a new one"
            )
    else:
        path.write_text(json.dumps(settings, indent=1))


def _evaluated(plan: EvalPlan) -> set[str]:
    """The tasks this evaluation answers: every loaded task for a model, the tasks the file answers for
    an answer set (a file may answer a few of the tasks loaded: the others are not part of it)."""
    if plan.mode == "answers":
        return {a.task_id for a in plan.answers}
    return {t.task_id for t in plan.task_set.tasks}


def _pending(plan: EvalPlan, attempt_log: AttemptLog) -> dict[str, list[tuple[int, str | None]]]:
    """task_id -> [(sample, answer text or None to sample)] not yet in the log."""
    out: dict[str, list[tuple[int, str | None]]] = {}
    if plan.mode == "answers":
        for a in plan.answers:
            if (a.task_id, a.sample) not in attempt_log.done:
                out.setdefault(a.task_id, []).append((a.sample, a.text))
    else:
        for task in plan.task_set.tasks:
            todo = [(s, None) for s in range(plan.samples) if (task.task_id, s) not in attempt_log.done]
            if todo:
                out[task.task_id] = todo
    return out


def _batches(tasks: list[Task], pending: dict, size: int) -> Iterator[list[tuple[Task, int, str | None]]]:
    """Whole tasks per batch, about `size` attempts each, in task order."""
    batch: list = []
    for task in tasks:
        batch += [(task, sample, text) for sample, text in pending.get(task.task_id, [])]
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _produce(plan: EvalPlan, pending: dict, attempt_log: AttemptLog, verifiers: VerifierSet, progress: Progress) -> int:
    """Answer, verify and log every pending attempt, batch by batch; returns how many attempts were
    sent for verification in this run."""
    size = max(1, plan.cfg.verifier.num_actors * plan.cfg.verifier.max_concurrent_requests)
    if plan.mode == "model" and plan.use_ray:
        return _produce_on_ray(plan, pending, attempt_log, verifiers, progress, size)
    sampler = _Sampler(plan) if plan.mode == "model" else None
    done_tasks = {task_id for task_id in _evaluated(plan) if task_id not in pending}
    try:
        for batch in _batches(plan.task_set.tasks, pending, size):
            if sampler is None:
                answers = [Answer(task=task, sample=sample, text=text) for task, sample, text in batch]
            else:
                answers = sampler.answers([(task, sample) for task, sample, _ in batch])
            with sampler.paused() if sampler else nullcontext():
                attempts = verified_attempts(answers, lambda reqs: verify_batch(verifiers, reqs))
            for attempt in attempts:
                attempt_log.append(attempt)
            done_tasks |= {task.task_id for task, _, _ in batch}
            progress.update(len(attempts), len(done_tasks))
    finally:
        if sampler is not None:
            sampler.close()
    return verifiers.sent


def _produce_on_ray(
    plan: EvalPlan, pending: dict, attempt_log: AttemptLog, verifiers: VerifierSet, progress: Progress, size: int
) -> int:
    """The engine in a RolloutActor on Ray; each batch through `RolloutActor.evaluate` (whose own
    verify client sends every sample of a batch's tasks to the verifiers)."""
    from launch.stages.eval.ray_sampler import RolloutSampler

    cfg = dataclasses.replace(plan.cfg, eval=dataclasses.replace(plan.cfg.eval, samples=plan.samples))
    sampler = RolloutSampler(cfg, verifiers.supervisor, gpu_share=0.5 if _engine_on_ray_gpu(plan) else 0.0)
    done_tasks = {task_id for task_id in _evaluated(plan) if task_id not in pending}
    sent = 0
    try:
        for batch in _batches(plan.task_set.tasks, pending, size):
            tasks = list({id(task): task for task, _, _ in batch}.values())
            wanted = {(task.task_id, sample) for task, sample, _ in batch}
            sampled = sampler.attempts(tasks)
            sent += len(sampled)
            attempts = [a for a in sampled if a.key in wanted]
            for attempt in attempts:
                attempt_log.append(attempt)
            done_tasks |= {task.task_id for task in tasks}
            progress.update(len(attempts), len(done_tasks))
    finally:
        sampler.close()
    return sent


def _engine_on_ray_gpu(plan: EvalPlan) -> bool:
    if not (plan.mode == "model" and plan.use_ray and plan.cfg.rollout.engine == "torch"):
        return False
    import torch

    return plan.cfg.rollout.device != "cpu" and torch.cuda.device_count() > 0


class _Sampler:
    """The evaluation's engine, tokenizer and first-turn prompts (model mode)."""

    def __init__(self, plan: EvalPlan) -> None:
        from actors.policy.tokenizer import load_tokenizer
        from actors.rollout.engines import make_engine
        from actors.rollout.evaluation import eval_params
        from actors.rollout.turns import TurnPolicy, TurnRules

        cfg = plan.cfg
        self.tokenizer = load_tokenizer(cfg.model)
        self.engine = make_engine(cfg.rollout, cfg.model, index=0, eos_token_ids=self.tokenizer.stop_ids)
        self.policy = TurnPolicy(TurnRules.first_turn(cfg.rollout, cfg.model), self.tokenizer)
        self.params = eval_params(cfg.eval, cfg.rollout, self.tokenizer.stop_ids)
        self.pause = cfg.verifier.backend == "cuda"  # a cpu verifier shares no GPU with the engine
        self._warned = False

    def answers(self, pairs: list[tuple[Task, int]]) -> list[Answer]:
        return first_turn_answers(
            pairs, generate=self.engine.generate, tokenizer=self.tokenizer, policy=self.policy, params=self.params
        )

    @contextmanager
    def paused(self):
        self._call("pause")
        try:
            yield
        finally:
            self._call("resume")

    def _call(self, what: str) -> None:
        if not self.pause:
            return
        try:
            getattr(self.engine, what)()
        except Exception as err:  # noqa: BLE001 - an external server without the endpoint: idle between batches anyway
            if not self._warned:
                log.warning("engine %s failed (%s); the engine is idle while verifying regardless", what, err)
                self._warned = True

    def close(self) -> None:
        self.engine.close()


def write_outputs(plan: EvalPlan, attempts: list[EvalAttempt], *, resumed: int, verified: int, seconds: float) -> dict:
    attempts = sorted(attempts, key=lambda a: (a.level, a.task_id, a.sample))
    summary = summarize(attempts, plan.ks, plan.cfg.eval.fast_threshold)
    doc = {
        "name": plan.name,
        "mode": plan.mode,
        "source": plan.source,
        "task_roots": plan.task_set.roots,
        "ks": list(summary.ks),
        "n": summary.n,
        "fast_threshold": summary.fast_threshold,
        "rows": table.summary_rows(summary),
        "sampling": plan.sampling,
        "verifier": verifier_settings(plan.cfg.verifier),
        "device": device_name(plan.cfg.verifier.backend),
        "toolchain": toolchain(plan.cfg.verifier.backend),
        "counts": {
            "attempts": len(attempts),
            "resumed": resumed,
            "verified": verified,
            "infra": sum(a.infra for a in attempts),
            "tasks": len({a.task_id for a in attempts}),
        },
        "failed_loads": [dataclasses.asdict(f) for f in plan.task_set.failed],
        "rejected_answers": plan.rejected_answers,
        "seconds": round(seconds, 1),
    }
    (plan.out / SUMMARY).write_text(json.dumps(doc, indent=1))
    text = f"# Evaluation: {plan.name}\n\n" + table.markdown_table([(plan.name, doc)]) + "\n"
    if plan.task_set.failed:
        text += "\nTask files that failed to load:\n\n" + "".join(
            f"* `{f.path}`: {f.reason}\n" for f in plan.task_set.failed
        )
    if plan.rejected_answers:
        text += "\nAnswers left out:\n\n" + "".join(f"* {line}\n" for line in plan.rejected_answers)
    (plan.out / TABLE).write_text(text)
    table.bar_chart(doc, plan.name, plan.out / CHART)
    return doc


def attempts_of(out: Path) -> list[EvalAttempt]:
    """The verified attempts an evaluation directory holds (for tools and tests)."""
    path = out / ATTEMPTS
    return [EvalAttempt.from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
