"""Kiln's verifier service as the reward of other trainers (docs/verifier.md, "The verifier service"):

* verl: `compute_score(data_source, solution_str, ground_truth, extra_info)`, the signature of verl's
  `custom_reward_function` (point its `path` at this file and `name` at `compute_score`);
* TRL: `TrlReward(...)`, a reward function for `GRPOTrainer(reward_funcs=[...])`, called as TRL calls
  one: `(prompts=..., completions=..., **dataset_columns) -> list[float | None]` (TRL also passes
  `completion_ids`, `trainer_state` and its logging hooks among the columns: they are not read).

Both reach the service at KILN_SERVE_URL with the token in KILN_SERVE_TOKEN (environment variables:
a token is never an argument that lands in a config file or a log). A sample names its task by the
reference's source or by a task id of the service's set.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from protocols.verifier_client import ServiceError, ServiceTimeout, VerifierClient

URL_VARIABLE = "KILN_SERVE_URL"
TOKEN_VARIABLE = "KILN_SERVE_TOKEN"


def client_from_environment() -> VerifierClient:
    url = os.environ.get(URL_VARIABLE)
    if not url:
        raise RuntimeError(f"set {URL_VARIABLE} to the verifier service's address (kiln serve prints it)")
    return VerifierClient(url, os.environ.get(TOKEN_VARIABLE) or None)


def compute_score(data_source, solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """verl's reward: `score` is Kiln's reward for the response (the rest is logged by verl's reward
    manager). The task: `extra_info["task_id"]` if the sample names one, else `ground_truth` is the
    reference's source."""
    task_id = (extra_info or {}).get("task_id")
    client = client_from_environment()
    if task_id:
        r = client.verify(solution_str, task_id=str(task_id))
    else:
        r = client.verify(solution_str, reference=str(ground_truth))
    return {
        "score": r.score,
        "passed": float(r.passed),
        "speedup_eager": r.speedup_eager or 0.0,
        "error_class": r.error_class or "",
    }


class TrlReward:
    """A TRL GRPOTrainer reward function: the verifier's score of each completion. The dataset's
    `reference_column` (the reference's source) or `task_column` (a task id of the service's set)
    names each sample's task. A conversational completion is scored by its last message. A sample
    the service could not judge (its deadline passed, or the service failed: a 5xx) scores `on_error`;
    None leaves it out of TRL's reward and advantage (TRL reads None as "no reward for this sample"),
    where 0 would pull its group's baseline towards 0. A request the service refuses as the caller's
    mistake (a wrong token, an unknown task id, a body over its limits: a 4xx) raises, as verl's
    `compute_score` does: a run must not train on with no reward at all."""

    def __init__(
        self,
        client: VerifierClient | None = None,
        reference_column: str = "reference",
        task_column: str = "task_id",
        on_error: float | None = 0.0,
        parallel: int = 8,
        deadline_s: float | None = None,
    ) -> None:
        self.client = client or client_from_environment()
        self.reference_column, self.task_column = reference_column, task_column
        self.on_error = on_error
        self.parallel = parallel  # requests in flight at once (each blocks until its verdict)
        self.deadline_s = deadline_s  # each request's deadline (None: the service's serve.deadline_s)
        self.__name__ = "kiln_verifier"  # TRL logs each reward function under its __name__

    def __call__(self, prompts=None, completions=None, **columns) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions or []]
        tasks = columns.get(self.task_column)
        references = columns.get(self.reference_column)
        if tasks is None and references is None:
            raise ValueError(f"the dataset needs a {self.reference_column!r} or a {self.task_column!r} column")

        def one(i: int) -> float | None:
            try:
                if tasks is not None and tasks[i]:
                    return self.client.verify(texts[i], task_id=str(tasks[i]), deadline_s=self.deadline_s).score
                return self.client.verify(texts[i], reference=str(references[i]), deadline_s=self.deadline_s).score
            except ServiceError as err:
                if isinstance(err, ServiceTimeout) or err.status >= 500:
                    return self.on_error
                raise

        with ThreadPoolExecutor(max(1, min(self.parallel, len(texts)))) as pool:
            return list(pool.map(one, range(len(texts))))
