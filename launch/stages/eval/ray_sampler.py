"""`kiln eval --ray --model ...`: the engine runs inside a `RolloutActor` on Ray, as in training,
and each batch is sampled and verified by `RolloutActor.evaluate` — the in-run validation's own
method. The actor asks "replay" for the validation tasks; here a small task-list server registered
under that name in the evaluation's registry answers with the current batch's tasks (and tells the
actor's training loop to stop at once: an evaluation has no task feed).

A batch is whole tasks at `eval.samples` samples each, so a resumed evaluation on Ray samples a
task that was cut short again in full and keeps only the samples its log lacks.
"""

from __future__ import annotations

import threading

from actors.base import Slot
from actors.rollout.evaluation import EvalAttempt
from configs import KilnConfig
from protocols import Task, TaskList, TaskListRequest, TaskReply, TaskRequest
from protocols.channels import ReplyServer

EVALUATE_TIMEOUT_S = 24 * 3600.0  # a batch of long answers on a slow engine; the actor is supervised by Ray


class RolloutSampler:
    def __init__(self, cfg: KilnConfig, supervisor, *, gpu_share: float) -> None:
        from actors.rollout.actor import RolloutActor
        from launch.driver.handles import RolloutHandle
        from launch.driver.supervisor import ActorSpec

        self._tasks: list[Task] = []
        self._stop = threading.Event()
        self._server = ReplyServer()
        self._thread = threading.Thread(
            target=self._server.serve, args=(self._answer, self._stop), daemon=True, name="kiln-eval-tasks"
        )
        self._thread.start()
        self.supervisor = supervisor
        supervisor.registry.register("replay", "replay", {"replay": self._server.address})
        slot = Slot(gpus=(0,), num_gpus=gpu_share) if gpu_share else Slot()
        self.handle = supervisor.launch(
            ActorSpec(
                name="rollout-0",
                cls=RolloutActor,
                handle=RolloutHandle,
                args=(cfg.rollout, cfg.model, cfg.eval),
                kwargs={"follow_learner": False},
                slot=slot,
            )
        )

    def _answer(self, record):
        if isinstance(record, TaskListRequest):
            return TaskList(split=record.split, tasks=list(self._tasks))
        if isinstance(record, TaskRequest):
            return TaskReply(status="stop")
        raise ValueError(f"an evaluation's task server answers task lists, not {type(record).__name__}")

    def attempts(self, tasks: list[Task]) -> list[EvalAttempt]:
        self._tasks = tasks
        return self.handle.evaluate(timeout_s=EVALUATE_TIMEOUT_S)

    def close(self) -> None:
        self.supervisor.stop_all(["rollout-"])
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()
