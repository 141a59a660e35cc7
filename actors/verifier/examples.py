"""An example reward actor for a non-kernel task: exact text match with smooth partial credit.

Use it with `verifier.reward_actor: actors.verifier.examples.TextMatchReward` and the matching task
source `replay.task_source: actors.buffer.examples.TextMatchTasks`. Tasks are of kind "text_match"
with payload {"prompt": str, "answer": str}. The candidate's first line (stripped) is the answer:
an exact match scores 1.0; anything else scores -1 + w·r, with r the character overlap ratio
(difflib) and w the constructor's `partial_credit` (1.5 unless `verifier.reward_actor_args` says
otherwise), so partial credit lies in [-1, -1 + w) and rises smoothly as a tiny model gets closer.
"""

from __future__ import annotations

import difflib

from actors.verifier.interface import RewardActor
from configs import VerifierConfig
from protocols import VerifyRequest, VerifyResult

KIND = "text_match"


class TextMatchReward(RewardActor):
    def __init__(self, cfg: VerifierConfig, *, partial_credit: float = 1.5) -> None:
        """`partial_credit` (from `verifier.reward_actor_args`): the score a full character overlap
        would add to -1; below 2, a near miss always scores under an exact match."""
        if not 0 <= partial_credit < 2:
            raise ValueError(f"partial_credit must lie in [0, 2), got {partial_credit}")
        self.cfg = cfg
        self.partial_credit = float(partial_credit)

    def verify(self, request: VerifyRequest) -> VerifyResult:
        task = request.task
        answer = task.payload.get("answer")
        if task.kind != KIND or not isinstance(answer, str):
            return self._result(
                request,
                passed=False,
                error_class="infra",
                q=0.0,
                score=0.0,
                feedback=f"TextMatchReward cannot score a task of kind {task.kind!r} "
                "(needs kind 'text_match' with a string payload['answer'])",
            )
        lines = request.candidate.strip().splitlines()
        got = lines[0].strip() if lines else ""
        if got == answer:
            return self._result(request, passed=True, error_class=None, q=1.0, score=1.0, feedback="Correct.", got=got)
        overlap = difflib.SequenceMatcher(None, got, answer).ratio()
        return self._result(
            request,
            passed=False,
            error_class="correctness",
            q=overlap,
            score=-1.0 + self.partial_credit * overlap,
            feedback=f"Wrong answer {got!r}: {overlap:.0%} of the characters match the expected "
            "answer. Answer on the first line, nothing else.",
            got=got,
        )

    def _result(
        self,
        request: VerifyRequest,
        *,
        passed: bool,
        error_class: str | None,
        q: float,
        score: float,
        feedback: str,
        got: str | None = None,
    ) -> VerifyResult:
        return VerifyResult(
            request_id=request.request_id,
            task_id=request.task.task_id,
            passed=passed,
            stage="done" if passed else ("run" if error_class == "infra" else "correctness"),
            error_class=error_class,
            q=q,
            score=score,
            feedback=feedback,
            diagnostics={} if got is None else {"answer": got},
        )
