"""The replay's formulas, pinned with hand-computed cases (actors/buffer/formulas.py, packing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from actors.buffer.formulas import (
    early_bonus,
    group_advantages,
    prime_echo,
    rewards_tie,
    sample_lag,
)
from actors.buffer.groups import Group, best_failed_attempt, judge
from actors.buffer.packing import episode_lag, gradient_versions, pack_batch
from configs import AlgoConfig
from protocols import Task, Turn
from tests.helpers.synthetic import TurnSpec, make_episode

PE = {"alpha": 0.75, "bonus_turn1": 0.2, "bonus_turn2": 0.1}
TASK = Task(task_id="t", kind="text_match", payload={"prompt": "Repeat: abc\n", "answer": "abc"})


# ----------------------------------------------------------------------------------- PrimeEcho


@pytest.mark.parametrize(
    "scores, passed, expected",
    [
        # pass at turn 1: 0.75*1.3 + 0.25*1.3 + 0.2
        ([1.3], [True], 1.5),
        # fail then pass at turn 2: 0.75*(-1) + 0.25*1.0 + 0.1
        ([-1.0, 1.0], [False, True], -0.4),
        # pass only at turn 3: no early bonus; 0.75*(-1) + 0.25*1.2
        ([-1.0, -0.75, 1.2], [False, False, True], -0.45),
        # never passes: 0.75*(-1) + 0.25*(-0.75)
        ([-1.0, -0.75], [False, False], -0.9375),
        # single failed turn: 0.75*(-0.5) + 0.25*(-0.5)
        ([-0.5], [False], -0.5),
        # a pass at turn 1 earns turn 1's bonus even if turn 2 passes as well
        ([1.0, 1.4], [True, True], 0.75 * 1.0 + 0.25 * 1.4 + 0.2),
    ],
)
def test_prime_echo_hand_computed(scores, passed, expected):
    assert prime_echo(scores, passed, **PE) == pytest.approx(expected)


def test_prime_echo_alpha_and_bonuses_are_parameters():
    # α = 1: first attempt only; α = 0: best attempt only; bonuses zeroed
    assert prime_echo([-1.0, 1.0], [False, True], alpha=1.0, bonus_turn1=0, bonus_turn2=0) == pytest.approx(-1.0)
    assert prime_echo([-1.0, 1.0], [False, True], alpha=0.0, bonus_turn1=0, bonus_turn2=0) == pytest.approx(1.0)
    assert prime_echo([-1.0, 1.0], [False, True], alpha=0.5, bonus_turn1=0.3, bonus_turn2=0.25) == pytest.approx(0.25)


def test_early_bonus_turn1_beats_turn2_and_later_passes_get_none():
    assert early_bonus([True], 0.2, 0.1) == 0.2
    assert early_bonus([False, True], 0.2, 0.1) == 0.1
    assert early_bonus([False, False, True], 0.2, 0.1) == 0.0
    assert early_bonus([False], 0.2, 0.1) == 0.0


def test_prime_echo_refuses_mismatched_inputs():
    with pytest.raises(ValueError):
        prime_echo([1.0, 1.0], [True], **PE)
    with pytest.raises(ValueError):
        prime_echo([], [], **PE)


# ---------------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    # mean 0.5, population std 0.5
    np.testing.assert_allclose(group_advantages([1.0, 0.0]), [1.0, -1.0], atol=1e-5)
    np.testing.assert_allclose(group_advantages([1.0, 0.0], std_norm=False), [0.5, -0.5])
    # mean 2, centred [1, -1, 0, 0], std sqrt(0.5)
    np.testing.assert_allclose(group_advantages([3.0, 1.0, 2.0, 2.0]), [2**0.5, -(2**0.5), 0, 0], atol=1e-5)
    np.testing.assert_allclose(group_advantages([3.0, 1.0, 2.0, 2.0], std_norm=False), [1, -1, 0, 0])
    # PrimeEcho rewards of a realistic group: [1.5, -0.4, -0.9375, -1.0]
    r = np.array([1.5, -0.4, -0.9375, -1.0])
    np.testing.assert_allclose(group_advantages(r), (r - r.mean()) / r.std(), rtol=1e-5)


def test_rewards_tie():
    assert rewards_tie([0.5, 0.5, 0.5])
    assert rewards_tie([-1.0, -1.0 + 1e-12])
    assert not rewards_tie([0.5, 0.6, 0.5])


def test_judge_group_uses_prime_echo_and_flags_tie_and_infra():
    algo = AlgoConfig(group_size=2, alpha=0.75, early_bonus_turn1=0.2, early_bonus_turn2=0.1)
    g = Group(group_id="g", task=TASK, size=2, last_activity=0.0)
    g.episodes[0] = make_episode(TASK, "g", 0, [TurnSpec(passed=True, score=1.3)])
    g.episodes[1] = make_episode(
        TASK, "g", 1, [TurnSpec(score=-1.0, text="a"), TurnSpec(score=-0.75, text="b", feedback="off by one")]
    )
    v = judge(g, algo)
    assert v.rewards == pytest.approx([1.5, -0.9375])
    assert v.advantages == pytest.approx([1.0, -1.0], abs=1e-5)
    assert v.any_passed and not v.tied and not v.infra and v.best_failed is None
    # the same group with no pass: the best failed attempt is the highest-scoring failed turn
    g.episodes[0] = make_episode(TASK, "g", 0, [TurnSpec(score=-1.0, text="c")])
    v = judge(g, algo)
    assert not v.any_passed
    assert (v.best_failed.code, v.best_failed.feedback, v.best_failed.score) == ("b", "off by one", -0.75)
    # one unverified turn makes the whole group the system's failure
    g.episodes[1] = make_episode(TASK, "g", 1, [TurnSpec(score=-1.0, verified=False)])
    assert judge(g, algo).infra
    g.episodes[1] = make_episode(TASK, "g", 1, [TurnSpec(score=-1.0, infra=True)])
    assert judge(g, algo).infra


def test_best_failed_attempt_skips_passed_turns():
    eps = [
        make_episode(TASK, "g", 0, [TurnSpec(score=-0.9, text="x"), TurnSpec(passed=True, score=1.2, text="y")]),
        make_episode(TASK, "g", 1, [TurnSpec(score=-0.6, text="z")]),
    ]
    assert best_failed_attempt(eps).code == "z"


# ---------------------------------------------------------------------------------- staleness


def test_sample_lag():
    assert sample_lag(5, [3, 4, 5]) == 2  # the oldest token decides
    assert sample_lag(5, np.array([5, 5])) == 0
    assert sample_lag(5, []) is None


def test_staleness_counts_only_gradient_carrying_tokens():
    ep = make_episode(
        TASK, "g", 0, [TurnSpec(score=-1.0, versions=[5, 5, 6]), TurnSpec(passed=True, score=1.0, versions=[2, 2])]
    )
    assert list(gradient_versions(ep, "first")) == [5, 5, 6]
    assert episode_lag(ep, 6, "first") == 1
    assert episode_lag(ep, 6, "all") == 4  # the old repair turn now carries gradient


# ------------------------------------------------------------------------------------- packing


def _turn(prompt, response, logprobs, versions):
    return Turn(
        prompt_ids=np.array(prompt),
        response_ids=np.array(response),
        logprobs=np.array(logprobs, np.float32),
        versions=np.array(versions),
        finish_reason="stop",
    )


def test_pack_batch_layout():
    ep = make_episode(TASK, "g", 0, [TurnSpec()])
    ep.turns = [_turn([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [7, 7, 8]), _turn([9], [10], [-0.5], [8])]
    ep.rewards = [-1.0, 1.0]
    b = pack_batch([ep], [0.5], version=8, train_turns="first")
    assert b.tokens.tolist() == [1, 2, 3, 4, 5]
    assert b.loss_mask.tolist() == [False, False, True, True, True]
    np.testing.assert_allclose(b.behaviour_logprobs, [0, 0, -0.1, -0.2, -0.3])
    assert b.versions.tolist() == [-1, -1, 7, 7, 8]
    assert b.cu_seqlens.tolist() == [0, 5] and b.advantages.tolist() == [0.5] and b.version == 8
    b = pack_batch([ep], [0.5], version=8, train_turns="all")
    assert b.tokens.tolist() == [1, 2, 3, 4, 5, 9, 10]
    assert b.cu_seqlens.tolist() == [0, 5, 7] and b.advantages.tolist() == [0.5, 0.5]
    assert b.loss_mask.tolist() == [False, False, True, True, True, False, True]
    assert b.versions.tolist() == [-1, -1, 7, 7, 8, -1, 8]
    b.check()
