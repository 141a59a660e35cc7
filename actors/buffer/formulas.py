"""The replay's formulas as small pure functions (docs/replay.md), so the learner, the docs and the tests
can point at one definition of each.

* `prime_echo`: the episode reward R = α·s_first + (1-α)·max_k s_k + b_early.
* `group_advantages` / `rewards_tie`: group-normalised advantages and the dynamic-sampling tie test.
* `sample_lag`: how far a sample's oldest gradient-carrying token lags the learner.

What the replay decides with them (admission, a group's fate, staleness) is in actors/decisions.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TIE_TOLERANCE = 1e-9  # rewards closer than this count as equal: their advantages would all be ~0
STD_EPS = 1e-6  # keeps std normalisation finite for near-tied groups that still pass the tie test


def early_bonus(passed: Sequence[bool], bonus_turn1: float, bonus_turn2: float) -> float:
    """b_early: `bonus_turn1` for a pass at turn 1, else `bonus_turn2` for a first pass at turn 2."""
    if passed and passed[0]:
        return bonus_turn1
    if len(passed) > 1 and passed[1]:
        return bonus_turn2
    return 0.0


def prime_echo(
    scores: Sequence[float], passed: Sequence[bool], *, alpha: float, bonus_turn1: float, bonus_turn2: float
) -> float:
    """PrimeEcho episode reward from per-turn scores s_k and per-turn pass flags.

    R = α·s_first + (1-α)·max_k s_k + b_early. The first-attempt term keeps the policy honest about
    its first try; the max term credits a successful repair; b_early rewards passing early."""
    if not scores or len(scores) != len(passed):
        raise ValueError(f"need one pass flag per turn score, got {len(scores)} scores, {len(passed)} flags")
    return alpha * scores[0] + (1.0 - alpha) * max(scores) + early_bonus(passed, bonus_turn1, bonus_turn2)


def rewards_tie(rewards: Sequence[float]) -> bool:
    """True when a group's rewards are all equal: every advantage is zero, so the group carries no
    learning signal and dynamic sampling drops it."""
    return max(rewards) - min(rewards) <= TIE_TOLERANCE


def group_advantages(rewards: Sequence[float], *, std_norm: bool = True) -> np.ndarray:
    """A_i = R_i - mean(R), divided by (std(R) + eps) when `std_norm`. std is the population std
    (ddof=0), so a two-sample group with rewards {1, 0} gets advantages {+1, -1}."""
    r = np.asarray(rewards, dtype=np.float64)
    centred = r - r.mean()
    if std_norm:
        centred = centred / (r.std() + STD_EPS)
    return centred.astype(np.float32)


def sample_lag(learner_version: int, token_versions: Sequence[int] | np.ndarray) -> int | None:
    """learner_version - min(token versions): the staleness of a sample, measured on its
    gradient-carrying tokens only. None when it has no such tokens (nothing to be stale)."""
    versions = np.asarray(token_versions)
    if versions.size == 0:
        return None
    return int(learner_version - versions.min())
