"""`kiln train`'s in-run validation, through the evaluation's own code: the rollout actor's verified
attempts (actors/rollout/evaluation.py) are summarized by launch/stages/eval/metrics.py and written by the
same writer as `kiln eval`'s (RUN_DIR/eval/step-NNNNNN/: table.md, summary.json, attempts.jsonl,
chart.png); the driver logs the flat numbers (`eval/pass@k`, `eval/avg@n`, `eval/faster_eager`, ...)."""

from __future__ import annotations

import logging
from pathlib import Path

from actors.rollout.evaluation import EvalAttempt
from configs import KilnConfig
from launch.stages.eval.attempt_log import AttemptLog
from launch.stages.eval.metrics import summarize
from launch.stages.eval.run import EvalPlan, write_outputs
from launch.stages.eval.sources import TaskSet
from protocols import metric_keys as mk

log = logging.getLogger(__name__)


def record_validation(
    cfg: KilnConfig, run_dir: Path, step: int, attempts: list[EvalAttempt], *, final: bool = False
) -> dict[str, float]:
    """The evaluation at `step` written out; its flat numbers for the metrics log (`eval/final`: 1 for
    the run's last evaluation). No attempts (no rollout actor to ask): nothing written, {}."""
    if not attempts:
        return {}
    out = run_dir / "eval" / f"step-{step:06d}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "attempts.jsonl").unlink(missing_ok=True)  # a resumed run evaluates this step afresh
    attempt_log = AttemptLog(out / "attempts.jsonl")
    try:
        for attempt in attempts:
            attempt_log.append(attempt)
    finally:
        attempt_log.close()
    plan = EvalPlan(
        name=f"step {step}",
        mode="validation",
        source=str(run_dir),
        task_set=TaskSet(tasks=[], failed=[], roots=[cfg.replay.tasks]),
        ks=(cfg.eval.k,),
        samples=cfg.eval.samples,
        out=out,
        cfg=cfg,
        sampling={"temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p},
    )
    write_outputs(plan, attempts, resumed=0, verified=len(attempts), seconds=0.0)
    values = summarize(attempts, plan.ks, cfg.eval.fast_threshold).metrics()
    values[mk.EVAL_FINAL] = float(final)
    log.info("evaluation at step %d: %s", step, {k: round(v, 3) for k, v in values.items()})
    return values
