"""An example reward actor for a multi-turn text task whose feedback names the fault, never the answer.

Use it with `verifier.reward_actor: actors.verifier.repair_text.RepairTextReward` and the matching
task source `replay.task_source: actors.buffer.repair_text.RepairTextTasks` (configs/examples/
repair_text.yaml). Tasks are of kind "repair_text" with payload {"prompt": str, "answer": str}, e.g.
"Reverse: abc" -> "cba", "Sort: cab" -> "abc", "Max: cab" -> "c".

The answer is read as the response's first len(answer) lowercase letters; every other character
written (outside leading and trailing whitespace) is extra output, which costs time, as work a slow
kernel does:
* The right letters and nothing else: a clean pass, score 1, speedup 1.
* The right letters with extra output: a pass, but a slow one, as a correct but slow kernel: its
  speedup is len(answer) / characters written < 1, its score 0.5 + 0.5·speedup, and its feedback
  says how many characters are extra. `rollout.optimize_turns` gives such a pass a performance turn
  (the turn policy calls a pass slow when speedup_eager < rollout.optimize_until).
* Anything else fails ("correctness"): the feedback says which positions are wrong and how many
  letters are missing, but never the right letters, so a repair turn has to use the positions it is
  told about. Its score is -1 + w·c, with c the mean over positions of 1 (right), `letter_credit` (a
  letter, but the wrong one) or 0 (missing), and w the constructor's `partial_credit` (1.5 unless
  `verifier.reward_actor_args` says otherwise), so every failure scores under 0.5 and every pass
  above it.
"""

from __future__ import annotations

import string

from actors.verifier.interface import RewardActor
from configs import VerifierConfig
from protocols import VerifyRequest, VerifyResult

KIND = "repair_text"
LETTERS = frozenset(string.ascii_lowercase)


def _positions(numbers: list[int]) -> str:
    """[2] -> 'letter 2'; [1, 3] -> 'letters 1 and 3'; [1, 2, 3] -> 'letters 1, 2 and 3'."""
    if len(numbers) == 1:
        return f"letter {numbers[0]}"
    head = ", ".join(str(n) for n in numbers[:-1])
    return f"letters {head} and {numbers[-1]}"


def judge(answer: str, text: str, *, partial_credit: float, letter_credit: float) -> dict:
    """The verdict on `text` for `answer` as plain fields: passed, q, score, speedup (passes only),
    feedback. Pure, so its rules have hand-computed tests."""
    n = len(answer)
    read = [c for c in text if c in LETTERS][:n]  # the answer as read: the first n lowercase letters
    wrong = [i + 1 for i, c in enumerate(read) if c != answer[i]]
    missing = n - len(read)
    if not wrong and not missing:
        written = len(text.strip())  # every character between the first and last that is not whitespace
        speedup = n / written
        extra = written - n
        feedback = (
            f"Correct, but slow: {extra} extra character{'s' * (extra != 1)}. Write the answer alone."
            if extra
            else "Correct."
        )
        return {"passed": True, "q": 1.0, "score": 0.5 + 0.5 * speedup, "speedup": speedup, "feedback": feedback}
    right = n - len(wrong) - missing
    credit = (right + letter_credit * len(wrong)) / n
    faults = []
    if wrong:
        faults.append(f"{_positions(wrong)} {'is' if len(wrong) == 1 else 'are'} wrong")
    if missing:
        faults.append(f"{missing} letter{'s are' if missing != 1 else ' is'} missing")
    return {
        "passed": False,
        "q": right / n,
        "score": -1.0 + partial_credit * credit,
        "speedup": None,
        "feedback": f"Wrong: {'; '.join(faults)}.",
    }


class RepairTextReward(RewardActor):
    def __init__(self, cfg: VerifierConfig, *, partial_credit: float = 1.5, letter_credit: float = 0.25) -> None:
        """`partial_credit` (from `verifier.reward_actor_args`): the score all-right positions would
        add to -1 (below 1.5 a failure always scores under a pass); `letter_credit`: the share of a
        right position's credit that a wrong lowercase letter earns (a fault of a kind the feedback
        names apart from a character that is not a letter at all)."""
        if not 0 <= partial_credit <= 1.5:
            raise ValueError(f"partial_credit must lie in [0, 1.5], got {partial_credit}")
        if not 0 <= letter_credit < 1:
            raise ValueError(f"letter_credit must lie in [0, 1), got {letter_credit}")
        self.cfg = cfg
        self.partial_credit = float(partial_credit)
        self.letter_credit = float(letter_credit)

    def verify(self, request: VerifyRequest) -> VerifyResult:
        task = request.task
        answer = task.payload.get("answer")
        if task.kind != KIND or not isinstance(answer, str) or not answer:
            return VerifyResult(
                request_id=request.request_id,
                task_id=task.task_id,
                passed=False,
                stage="run",
                error_class="infra",
                q=0.0,
                score=0.0,
                feedback=f"RepairTextReward cannot score a task of kind {task.kind!r} "
                "(needs kind 'repair_text' with a non-empty string payload['answer'])",
            )
        v = judge(answer, request.candidate, partial_credit=self.partial_credit, letter_credit=self.letter_credit)
        return VerifyResult(
            request_id=request.request_id,
            task_id=task.task_id,
            passed=v["passed"],
            stage="done" if v["passed"] else "correctness",
            error_class=None if v["passed"] else "correctness",
            q=v["q"],
            score=v["score"],
            speedup_eager=v["speedup"],
            feedback=v["feedback"],
            diagnostics={"answer": request.candidate[: len(answer)]},
        )
