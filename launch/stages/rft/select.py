"""`kiln rft`'s filter: from verified episodes to chat examples that are correct and diverse.

Kept: each attempt that passed at its first turn (a single-turn example), and with `keep_repairs` each
attempt that failed first and ended in a pass (the whole repair dialogue: its failed answers are context
with `train: false`, the feedback on them user messages as the turn policy wrote them, the passing
answer trained on). Infra verdicts never count as a pass or a failure.

Deduplication is by normalised source (launch/stages/rft/normalise.py): a first attempt by its answer's key, a
repair dialogue by the keys of all its answers. Of copies, the fastest is kept (speedup over eager,
unknown counting as slowest). At most `max_per_task` distinct examples are kept per task: the fastest
first, first attempts before repair dialogues at equal speed, so what a task keeps are distinct
implementations and its faster kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from actors.policy.chat_data import ChatExample, first_code_block
from actors.policy.prompts import opening, optimize_request, repair_request
from actors.policy.tokenizer import Message
from launch.stages.rft.normalise import source_key
from protocols import Episode, Task


@dataclass(frozen=True)
class Candidate:
    example: ChatExample
    key: str
    speedup: float | None
    kind: Literal["first", "repair"]
    order: int  # position among the task's candidates, for stable ties

    @property
    def rank(self) -> tuple:
        return (-(self.speedup if self.speedup is not None else float("-inf")), self.kind != "first", self.order)


@dataclass
class TaskYield:
    """One row of the yield table."""

    task_id: str
    samples: int = 0
    infra: int = 0
    passed_first: int = 0
    passed_repair: int = 0
    distinct: int = 0
    kept: int = 0


def code_of(answer: str) -> str:
    block = first_code_block(answer)
    return block if block is not None else answer


def candidates(task: Task, episodes: list[Episode], keep_repairs: bool, row: TaskYield) -> list[Candidate]:
    out: list[Candidate] = []
    for episode in episodes:
        row.samples += 1
        turns = episode.turns
        if not turns or any(t.result is not None and t.result.error_class == "infra" for t in turns):
            row.infra += 1
            continue
        last = turns[-1].result
        if not last.passed:
            continue
        meta = {
            "source": "kiln rft",
            "speedup_eager": last.speedup_eager,
            "turns": len(turns),
            "episode": episode.episode_id,
        }
        if len(turns) == 1:
            row.passed_first += 1
            messages = (*opening(task), Message("assistant", turns[0].text, turns[0].reasoning))
            example = ChatExample(messages=messages, task_id=task.task_id, meta={**meta, "kind": "first"})
            out.append(Candidate(example, source_key(code_of(turns[0].text)), last.speedup_eager, "first", len(out)))
            continue
        row.passed_repair += 1
        if keep_repairs:
            example = _dialogue(task, episode, meta)
            key = "+".join(source_key(code_of(t.text)) for t in turns)
            out.append(Candidate(example, key, last.speedup_eager, "repair", len(out)))
    return out


def _dialogue(task: Task, episode: Episode, meta: dict) -> ChatExample:
    """The attempt's whole dialogue: failed answers as context, the passing one trained on."""
    messages = list(opening(task))
    untrained = []
    turns = episode.turns
    for k, turn in enumerate(turns):
        messages.append(Message("assistant", turn.text, turn.reasoning))
        if k + 1 < len(turns):
            untrained.append(len(messages) - 1)
            follow = turns[k + 1].kind
            messages.append(
                Message(
                    "user",
                    optimize_request(task, turn.result)
                    if follow == "optimize"
                    else repair_request(task, turn.result.feedback),
                )
            )
    return ChatExample(
        messages=tuple(messages), untrained=frozenset(untrained), task_id=task.task_id, meta={**meta, "kind": "repair"}
    )


def choose(found: list[Candidate], max_per_task: int, row: TaskYield) -> list[Candidate]:
    """The distinct candidates (the fastest copy of each), best first, at most `max_per_task` (0 = all)."""
    best: dict[str, Candidate] = {}
    for c in found:
        if c.key not in best or c.rank < best[c.key].rank:
            best[c.key] = c
    distinct = sorted(best.values(), key=lambda c: c.rank)
    row.distinct = len(distinct)
    kept = distinct[:max_per_task] if max_per_task else distinct
    row.kept = len(kept)
    return kept


def yield_table(rows: list[TaskYield]) -> str:
    head = ("task", "samples", "infra", "pass@turn1", "pass after repair", "distinct", "kept")
    body = [(r.task_id, r.samples, r.infra, r.passed_first, r.passed_repair, r.distinct, r.kept) for r in rows]
    total = ("total", *(sum(r[i] for r in body) for i in range(1, len(head))))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, total, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in body] + [fmt.format(*total)]
    return "\n".join(lines)
