"""The replay's formulas as small pure functions (docs/replay.md), so the learner, the docs and the tests
can point at one definition of each.

* `prime_echo`: the episode reward R = α·s_first + (1-α)·max_k s_k + b_early.
* `group_advantages` / `rewards_tie`: group-normalised advantages and the dynamic-sampling tie test.
* `turn_values` / `floor_passing_turns` / `pooled_advantages`: per-turn credit of a multi-turn attempt
  (`algo.turn_credit=per_turn`): each turn's value, the floor that keeps a pass above every failure of
  its group, and advantages normalised over all the group's turns.
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


def turn_values(scores: Sequence[float], reward: float, *, gamma: float) -> list[float]:
    """Per-turn values of one attempt from its turn scores s_k and its PrimeEcho reward R:

        v_1 = R                                           turn 1: its quality anchors the attempt
        v_k = Σ_{j>=k} γ^(j-k)·s_j / Σ_{j>=k} γ^(j-k)       a later turn: the γ-weighted mean of the
                                                          scores from it to the attempt's end

    A repair turn is credited with what it and the turns after it achieved, not with the failure
    before it. The weighted mean (not the plain discounted sum) keeps every value on the scores' own
    scale, so turns of every position, and attempts of every length, are compared against one
    baseline, and an attempt that fails every turn is valued -1 on every turn (its group ties rather
    than training the middle turns down for their position). With γ = 0.5, scores (-0.25, -1, 1.5)
    and R = 0.1875 give (0.1875, (-1 + 0.75) / 1.5, 1.5) = (0.1875, -0.1667, 1.5)."""
    if not scores:
        raise ValueError("an attempt has at least one turn")
    values, total, weight = [], 0.0, 0.0
    for s in reversed(scores[1:]):
        total, weight = float(s) + gamma * total, 1.0 + gamma * weight
        values.append(total / weight)
    return [float(reward), *reversed(values)]


def floor_passing_turns(values: Sequence[Sequence[float]], passed: Sequence[Sequence[bool]]) -> list[list[float]]:
    """v_k ← max(v_k, max{v_j : turn j of the group failed}) for every passing turn k of the group
    (`values[i][k]`, `passed[i][k]`: episode i, turn k). Advantages are an increasing function of
    values, so after this floor no passing turn's advantage is below any failed turn's of its group:
    a guarantee by construction, whatever the scores, γ and PrimeEcho's constants."""
    failed = [v for vs, ps in zip(values, passed, strict=True) for v, p in zip(vs, ps, strict=True) if not p]
    floor = max(failed, default=-np.inf)
    return [
        [max(v, floor) if p else v for v, p in zip(vs, ps, strict=True)] for vs, ps in zip(values, passed, strict=True)
    ]


def pooled_advantages(values: Sequence[Sequence[float]], *, std_norm: bool = True) -> list[list[float]]:
    """A_ik = v_ik - mean(v), divided by (std(v) + eps) when `std_norm`, where mean and std (population,
    ddof=0) are pooled over every turn value v of the group (`values[i][k]`: episode i, turn k): one
    baseline for all the group's turns, so a turn is judged against the turns of the same task."""
    flat = np.asarray([v for vs in values for v in vs], dtype=np.float64)
    centred = flat - flat.mean()
    if std_norm:
        centred = centred / (flat.std() + STD_EPS)
    pooled = iter(centred.tolist())
    return [[next(pooled) for _ in vs] for vs in values]


def sample_lag(learner_version: int, token_versions: Sequence[int] | np.ndarray) -> int | None:
    """learner_version - min(token versions): the staleness of a sample, measured on its
    gradient-carrying tokens only. None when it has no such tokens (nothing to be stale)."""
    versions = np.asarray(token_versions)
    if versions.size == 0:
        return None
    return int(learner_version - versions.min())
