"""The turn policy of one attempt (docs/rollout.md): after each verdict, what the policy is asked next,
or that the attempt is done. A pure function of the attempt so far and the verdict, so the episode
loop that calls it (the per-attempt pipeline, actors/rollout/episodes.py) holds no turn logic.

Interface:

    policy = TurnPolicy(TurnRules.from_config(rollout, model, evaluation), tokenizer)
    decision = policy.next_prompt(Attempt.of(task), None)         # the first prompt (or Done)
    while isinstance(decision, Prompt):
        response = <generate from decision.ids, split with tokenizer.split_response>
        attempt = decision.attempt.answered(decision.kind, response)
        verdict = <verify response.answer>
        decision = policy.next_prompt(attempt, verdict)

`next_prompt(attempt, verdict)` takes the attempt whose newest exchange is the answer `verdict`
judges (None before the first turn) and returns a `Prompt` (its kind, the conversation, its token
ids, how many earlier exchanges it leaves out, and the attempt with the follow-up message added) or
a `Done` with its reason. It never mutates its inputs and never touches a socket or a clock; the
tokenizer only renders.

The rules, in order:
1. An infra verdict ends the attempt ("infra": the system failed, more turns are waste).
2. A pass ends it ("passed"), unless it is slow (speedup vs eager below `rollout.optimize_until`,
   null = `eval.fast_threshold`, the speedup the evaluation counts as faster), `rollout.optimize_turns`
   is not used up and turns remain: then a performance turn ("optimize") with the timing feedback
   (the candidate's time and each baseline's) and the speedup to beat.
3. A failure gets a repair turn ("repair") with the verifier's feedback while turns remain
   (`rollout.max_turns`, performance turns included), else ends ("failed").
The conversation is the dialogue so far: the opening (system rules, user task), then each answer
as an assistant turn and the feedback on it as a user turn. A Buffered-Dynamic-Retry task starts
with its failed answer and feedback as an inherited exchange, so its first prompt is already a repair.

History: `rollout.history=full` shows every exchange, `last` only the newest. When the rendered
conversation plus `rollout.max_new_tokens` exceeds `model.max_seq_len`, the oldest exchanges are
left out until it fits, and the task's message says how many. A repair or performance prompt keeps
at least the newest exchange (the answer it is about); when even that does not fit the attempt ends
("context", not infra: the policy's answers are fine, the context is too small). A first prompt that
does not fit even alone makes the task unservable ("unservable"), with its size in the detail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from actors.policy.prompts import elision_note, opening, optimize_request, repair_request
from actors.policy.tokenizer import Message, Response
from configs import EvalConfig, ModelConfig, RolloutConfig
from protocols import Task, TurnKind, VerifyResult

DoneReason = Literal["passed", "failed", "infra", "context", "unservable"]


@dataclass(frozen=True)
class TurnRules:
    """The settings the policy reads (from `rollout.*` and `model.*`)."""

    max_turns: int
    max_seq_len: int
    max_new_tokens: int
    history: Literal["full", "last"] = "full"
    history_thinking: bool = False
    optimize_turns: int = 0
    optimize_until: float = 1.0  # a pass with a speedup vs eager below this is slow
    enable_thinking: bool = False

    @classmethod
    def from_config(
        cls, rollout: RolloutConfig, model: ModelConfig, evaluation: EvalConfig, *, max_turns: int | None = None
    ) -> TurnRules:
        """The rules of a run; `evaluation` gives the speedup that counts as faster, which a slow pass
        has to beat when `rollout.optimize_until` is null."""
        until = rollout.optimize_until
        return cls(
            max_turns=rollout.max_turns if max_turns is None else max_turns,
            max_seq_len=model.max_seq_len,
            max_new_tokens=rollout.max_new_tokens,
            history=rollout.history,
            history_thinking=rollout.history_thinking,
            optimize_turns=rollout.optimize_turns,
            optimize_until=evaluation.fast_threshold if until is None else until,
            enable_thinking=model.enable_thinking,
        )

    @classmethod
    def first_turn(cls, rollout: RolloutConfig, model: ModelConfig) -> TurnRules:
        """The rules of first prompts alone (evaluation, start-up checks, benchmarks): one turn, so
        no repair or performance turn follows."""
        return cls(
            max_turns=1,
            max_seq_len=model.max_seq_len,
            max_new_tokens=rollout.max_new_tokens,
            history=rollout.history,
            history_thinking=rollout.history_thinking,
            enable_thinking=model.enable_thinking,
        )


@dataclass(frozen=True)
class Exchange:
    """One answer of the dialogue and the user message that followed it ("" until its verdict)."""

    kind: TurnKind  # what the prompt that this answers asked
    answer: str
    reasoning: str = ""
    followup: str = ""
    inherited: bool = False  # from a retry task's repair context: shown, but not a turn of this attempt


@dataclass(frozen=True)
class Attempt:
    """A task and the exchanges of its dialogue so far, oldest first."""

    task: Task
    exchanges: tuple[Exchange, ...] = ()

    @classmethod
    def of(cls, task: Task) -> Attempt:
        """A fresh attempt; a retry task's failed answer and feedback come first, as an inherited exchange."""
        if task.repair is None:
            return cls(task)
        inherited = Exchange(
            kind="repair",
            answer=task.repair.failed_code,
            inherited=True,
            followup=repair_request(task, task.repair.feedback),
        )
        return cls(task, (inherited,))

    def answered(self, kind: TurnKind, response: Response) -> Attempt:
        return replace(
            self,
            exchanges=self.exchanges + (Exchange(kind=kind, answer=response.answer, reasoning=response.reasoning),),
        )

    @property
    def turns(self) -> int:
        return sum(not e.inherited for e in self.exchanges)

    @property
    def optimize_turns(self) -> int:
        return sum(e.kind == "optimize" and not e.inherited for e in self.exchanges)


@dataclass(frozen=True)
class Prompt:
    kind: TurnKind
    messages: tuple[Message, ...]
    ids: tuple[int, ...]
    left_out: int  # earlier exchanges not shown (history=last, or elided to fit)
    attempt: Attempt  # the dialogue this prompt renders, its newest follow-up included


@dataclass(frozen=True)
class Done:
    reason: DoneReason
    detail: str = ""


class TurnPolicy:
    """`next_prompt` over fixed rules and a tokenizer (anything with `render(messages, enable_thinking=)`)."""

    def __init__(self, rules: TurnRules, tokenizer) -> None:
        self.rules, self.tokenizer = rules, tokenizer

    def next_prompt(self, attempt: Attempt, verdict: VerifyResult | None) -> Prompt | Done:
        if verdict is None:
            if attempt.turns:
                raise ValueError("a verdict is needed once the attempt has answered")
            return self._first(attempt)
        if not attempt.exchanges or attempt.exchanges[-1].inherited or attempt.exchanges[-1].followup:
            raise ValueError("the verdict must judge the attempt's newest answer")
        r = self.rules
        if verdict.error_class == "infra":
            return Done("infra", verdict.feedback)
        turns_left = attempt.turns < r.max_turns
        if verdict.passed:
            if turns_left and attempt.optimize_turns < r.optimize_turns and self.slow(verdict):
                return self._follow(attempt, "optimize", optimize_request(attempt.task, verdict, r.optimize_until))
            return Done("passed")
        if not turns_left:
            return Done("failed")
        return self._follow(attempt, "repair", repair_request(attempt.task, verdict.feedback))

    def slow(self, verdict: VerifyResult) -> bool:
        """A speedup vs eager below `optimize_until`; unknown speed is never called slow."""
        s = verdict.speedup_eager
        return s is not None and s < self.rules.optimize_until

    # ------------------------------------------------------------------------------ building

    def _first(self, attempt: Attempt) -> Prompt | Done:
        try:
            head = opening(attempt.task)
        except ValueError as err:
            return Done("unservable", str(err))
        prompt = self._fit(attempt, head, "repair", keep=0)
        if prompt is None:
            alone = len(self._render(head))
            return Done(
                "unservable",
                f"its first prompt is {alone} tokens; with rollout.max_new_tokens = "
                f"{self.rules.max_new_tokens} that exceeds model.max_seq_len = "
                f"{self.rules.max_seq_len}",
            )
        if prompt.left_out == len(attempt.exchanges):  # nothing inherited is shown: a plain first turn
            prompt = replace(prompt, kind="first")
        return prompt

    def _follow(self, attempt: Attempt, kind: TurnKind, followup: str) -> Prompt | Done:
        last = replace(attempt.exchanges[-1], followup=followup)
        attempt = replace(attempt, exchanges=attempt.exchanges[:-1] + (last,))
        prompt = self._fit(attempt, opening(attempt.task), kind, keep=1)
        if prompt is None:
            return Done(
                "context",
                f"the task and its newest answer and feedback exceed model.max_seq_len = "
                f"{self.rules.max_seq_len} with rollout.max_new_tokens = {self.rules.max_new_tokens}",
            )
        return prompt

    def _fit(self, attempt: Attempt, head: list[Message], kind: TurnKind, keep: int) -> Prompt | None:
        """The conversation with as many of the newest exchanges as fit (at least `keep`); None when
        even `keep` do not."""
        shown = list(attempt.exchanges) if self.rules.history == "full" else list(attempt.exchanges[-1:])
        while True:
            left_out = len(attempt.exchanges) - len(shown)
            messages = self._conversation(head, shown, left_out)
            ids = self._render(messages)
            if len(ids) + self.rules.max_new_tokens <= self.rules.max_seq_len:
                return Prompt(kind=kind, messages=tuple(messages), ids=tuple(ids), left_out=left_out, attempt=attempt)
            if len(shown) <= keep:
                return None
            shown.pop(0)

    def _conversation(self, head: list[Message], shown: Sequence[Exchange], left_out: int) -> list[Message]:
        messages = list(head)
        if left_out and shown:
            task = messages[-1]
            messages[-1] = replace(task, content=task.content.rstrip("\n") + elision_note(left_out))
        for e in shown:
            reasoning = e.reasoning if self.rules.history_thinking else ""
            messages += [Message("assistant", e.answer, reasoning), Message("user", e.followup)]
        return messages

    def _render(self, messages: Sequence[Message]) -> list[int]:
        return list(self.tokenizer.render(messages, enable_thinking=self.rules.enable_thinking))
