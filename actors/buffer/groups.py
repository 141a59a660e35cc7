"""GRPO groups: the G episodes sampled for one served task, and the verdict on a completed group.

A group is opened when the task feed hands out a task and complete when all G sample slots hold an
episode. `judge` turns a complete group into what the replay needs to decide its fate: whether the
system failed it (infra), each episode's PrimeEcho reward, each gradient-carrying turn's advantage
(`credit`: per turn or per episode, `algo.turn_credit`), whether they all tie, whether any sample
passed, and the best failed attempt for Buffered Dynamic Retry. The fate itself is decided in
actors/decisions.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import protocols
from actors.buffer.formulas import (
    floor_passing_turns,
    group_advantages,
    pooled_advantages,
    prime_echo,
    rewards_tie,
    turn_values,
)
from actors.buffer.packing import gradient_turns
from actors.buffer.retry_buffer import FailedAttempt
from actors.decisions import GroupOutcome
from configs import AlgoConfig
from protocols import Episode, Task, Turn


@dataclass
class Group:
    group_id: str
    task: Task  # as served: a repair task carries task.repair
    size: int
    last_activity: float  # monotonic time of issue or of its latest episode, for expiry
    episodes: dict[int, Episode] = field(default_factory=dict)  # by sample_index
    # set once the group is judged trainable: per episode in sample order, one per gradient-carrying turn
    advantages: list[list[float]] = field(default_factory=list)
    actor_id: str = ""  # the rollout actor working on it (its groups are released if it dies)

    @property
    def is_retry(self) -> bool:
        return self.task.repair is not None

    @property
    def complete(self) -> bool:
        return len(self.episodes) == self.size

    def ordered(self) -> list[Episode]:
        return [self.episodes[i] for i in sorted(self.episodes)]

    def dump(self) -> dict:
        return {
            "group_id": self.group_id,
            "task": protocols.encode(self.task),
            "size": self.size,
            "episodes": [protocols.encode(e) for e in self.ordered()],
            "advantages": self.advantages,
            "actor_id": self.actor_id,
        }

    @classmethod
    def load(cls, data: dict, now: float) -> Group:
        episodes = [protocols.decode(b) for b in data["episodes"]]
        return cls(
            group_id=data["group_id"],
            task=protocols.decode(data["task"]),
            size=data["size"],
            last_activity=now,
            episodes={e.sample_index: e for e in episodes},
            advantages=[list(a) for a in data["advantages"]],
            actor_id=data.get("actor_id", ""),
        )


def turn_passed(turn: Turn) -> bool:
    return turn.result is not None and turn.result.passed


def turn_infra(turn: Turn) -> bool:
    """A turn without a verdict, or with an infra error, failed through the system's fault."""
    return turn.result is None or turn.result.error_class == "infra"


def episode_passed(ep: Episode) -> bool:
    return any(turn_passed(t) for t in ep.turns)


def episode_reward(ep: Episode, algo: AlgoConfig) -> float:
    return prime_echo(
        ep.rewards,
        [turn_passed(t) for t in ep.turns],
        alpha=algo.alpha,
        bonus_turn1=algo.early_bonus_turn1,
        bonus_turn2=algo.early_bonus_turn2,
    )


def best_failed_attempt(episodes: list[Episode]) -> FailedAttempt | None:
    """The highest-scoring failed turn over all samples (first one on a tie)."""
    best: FailedAttempt | None = None
    for ep in episodes:
        for turn, score in zip(ep.turns, ep.rewards, strict=True):
            if turn_passed(turn) or turn.result is None:
                continue
            if best is None or score > best.score:
                best = FailedAttempt(code=turn.text, feedback=turn.result.feedback, score=float(score))
    return best


@dataclass(frozen=True)
class Credit:
    """What a group's turns are credited with."""

    advantages: list[list[float]]  # per episode in sample order, one per gradient-carrying turn
    tied: bool  # the credited values all tie: every advantage is zero, the group carries no signal


def credit(episodes: list[Episode], rewards: list[float], algo: AlgoConfig) -> Credit:
    """Each gradient-carrying turn's advantage (docs/replay.md, "Per-turn credit"). `per_turn`: turn 1
    is valued at its episode's PrimeEcho R, a later turn at the weighted mean of its own and the later
    turns' scores (`turn_values`), a passing turn at no less than the group's best failed turn
    (`floor_passing_turns`), and advantages are normalised over all the group's gradient-carrying
    turns (`pooled_advantages`). `episode`: each episode's group-normalised R on every turn it trains."""
    counts = [len(gradient_turns(ep, algo.train_turns)) for ep in episodes]
    if algo.turn_credit == "episode":
        advantages = group_advantages(rewards, std_norm=algo.adv_std_norm)
        return Credit([[float(a)] * n for a, n in zip(advantages, counts, strict=True)], rewards_tie(rewards))
    values = [
        turn_values(ep.rewards, r, gamma=algo.turn_discount)[:n]
        for ep, r, n in zip(episodes, rewards, counts, strict=True)
    ]
    passed = [[turn_passed(t) for t in ep.turns[:n]] for ep, n in zip(episodes, counts, strict=True)]
    floored = floor_passing_turns(values, passed)
    return Credit(
        pooled_advantages(floored, std_norm=algo.adv_std_norm), rewards_tie([v for vs in floored for v in vs])
    )


def turns_with_own_credit(ep: Episode, algo: AlgoConfig) -> int:
    """Turns after the first that carry gradient with their own per-turn advantage (the replay's
    `turn_credited_turns`): none with `algo.turn_credit=episode` or `algo.train_turns=first`."""
    return len(gradient_turns(ep, algo.train_turns)) - 1 if algo.turn_credit == "per_turn" else 0


@dataclass
class Verdict:
    infra: bool  # some turn failed through the system's fault: the rewards are not the policy's
    rewards: list[float]  # each episode's PrimeEcho R
    advantages: list[list[float]]  # per episode, one per gradient-carrying turn (`credit`)
    tied: bool
    any_passed: bool
    best_failed: FailedAttempt | None
    unservable: str = ""  # the rollout could not pose the task at all (why); the task leaves the feed

    def outcome(self, is_retry: bool) -> GroupOutcome:
        """What the group's fate depends on (actors/decisions.py)."""
        return GroupOutcome(
            is_retry=is_retry,
            unservable=self.unservable,
            infra=self.infra,
            tied=self.tied,
            any_passed=self.any_passed,
            has_failed_attempt=self.best_failed is not None,
        )


def judge(group: Group, algo: AlgoConfig) -> Verdict:
    episodes = group.ordered()
    unservable = next((ep.unservable for ep in episodes if ep.unservable), "")
    if unservable or any(turn_infra(t) for ep in episodes for t in ep.turns):
        return Verdict(
            infra=True, rewards=[], advantages=[], tied=False, any_passed=False, best_failed=None, unservable=unservable
        )
    rewards = [episode_reward(ep, algo) for ep in episodes]
    any_passed = any(episode_passed(ep) for ep in episodes)
    credited = credit(episodes, rewards, algo)
    return Verdict(
        infra=False,
        rewards=rewards,
        advantages=credited.advantages,
        tied=credited.tied,
        any_passed=any_passed,
        best_failed=None if any_passed else best_failed_attempt(episodes),
    )
