"""The replay's formulas, pinned with hand-computed cases (actors/buffer/formulas.py, packing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from actors.buffer.formulas import (
    early_bonus,
    floor_passing_turns,
    group_advantages,
    pooled_advantages,
    prime_echo,
    rewards_tie,
    sample_lag,
    turn_values,
)
from actors.buffer.groups import Group, best_failed_attempt, judge, turns_with_own_credit
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
    algo = AlgoConfig(group_size=2, alpha=0.75, early_bonus_turn1=0.2, early_bonus_turn2=0.1, turn_credit="episode")
    g = Group(group_id="g", task=TASK, size=2, last_activity=0.0)
    g.episodes[0] = make_episode(TASK, "g", 0, [TurnSpec(passed=True, score=1.3)])
    g.episodes[1] = make_episode(
        TASK, "g", 1, [TurnSpec(score=-1.0, text="a"), TurnSpec(score=-0.75, text="b", feedback="off by one")]
    )
    v = judge(g, algo)
    assert v.rewards == pytest.approx([1.5, -0.9375])
    assert v.advantages[0] == pytest.approx([1.0], abs=1e-5)  # one advantage per gradient-carrying turn
    assert v.advantages[1] == pytest.approx([-1.0, -1.0], abs=1e-5)  # episode credit: its R's on both turns
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
    b = pack_batch([ep], [[0.5]], version=8, train_turns="first")
    assert b.tokens.tolist() == [1, 2, 3, 4, 5]
    assert b.loss_mask.tolist() == [False, False, True, True, True]
    np.testing.assert_allclose(b.behaviour_logprobs, [0, 0, -0.1, -0.2, -0.3])
    assert b.versions.tolist() == [-1, -1, 7, 7, 8]
    assert b.cu_seqlens.tolist() == [0, 5] and b.advantages.tolist() == [0.5] and b.version == 8
    assert b.episode_ids == [ep.episode_id]
    b = pack_batch([ep], [[0.5, -0.25]], version=8, train_turns="all")
    assert b.tokens.tolist() == [1, 2, 3, 4, 5, 9, 10]
    assert b.cu_seqlens.tolist() == [0, 5, 7] and b.advantages.tolist() == [0.5, -0.25]  # each turn its own
    assert b.loss_mask.tolist() == [False, False, True, True, True, False, True]
    assert b.versions.tolist() == [-1, -1, 7, 7, 8, -1, 8]
    assert b.episode_ids == [ep.episode_id] * 2  # the episode of each sequence
    b.check()


def test_pack_batch_puts_each_turns_advantage_on_its_sequence_and_refuses_a_miscount():
    one = make_episode(TASK, "g", 0, [TurnSpec(passed=True, score=1.3, prompt_len=2, response_len=1)])
    two = make_episode(
        TASK, "g", 1, [TurnSpec(score=-1.0, prompt_len=3, response_len=2), TurnSpec(passed=True, prompt_len=1)]
    )
    b = pack_batch([one, two], [[1.25], [-0.5, 0.75]], version=0, train_turns="all")
    assert b.episode_ids == [one.episode_id, two.episode_id, two.episode_id]
    assert b.cu_seqlens.tolist() == [0, 3, 8, 14] and b.advantages.tolist() == [1.25, -0.5, 0.75]
    seq = np.repeat(np.arange(3), np.diff(b.cu_seqlens))  # every token of a sequence reads its advantage
    assert b.advantages[seq[b.loss_mask]].tolist() == [1.25] + [-0.5] * 2 + [0.75] * 5
    with pytest.raises(ValueError, match="1 advantages for 2 gradient-carrying turns"):
        pack_batch([one, two], [[1.25], [-0.5]], version=0, train_turns="all")
    with pytest.raises(ValueError, match="2 advantages for 1 gradient-carrying turns"):
        pack_batch([one, two], [[1.25], [-0.5, 0.75]], version=0, train_turns="first")


# ----------------------------------------------------------------------------- per-turn credit

# The review's group of four (α = 0.75, bonuses 0.2 / 0.1): per-turn scores and pass flags. A pass scores >= 1.
REVIEW = [
    ([1.3], [True]),  # A: passes at once; R = 0.75·1.3 + 0.25·1.3 + 0.2 = 1.5
    ([-1.0, 1.0], [False, True]),  # B: a successful repair; R = -0.75 + 0.25 + 0.1 = -0.4
    ([-0.25, -1.0, 1.5], [False, False, True]),  # C: passes at turn 3; R = -0.1875 + 0.375 = 0.1875
    ([-1.0, -0.25, -1.0], [False, False, False]),  # D: never passes; R = -0.75 - 0.0625 = -0.8125
]
REVIEW_R = [1.5, -0.4, 0.1875, -0.8125]
# turn 1: R; turn k > 1: the 0.5-weighted mean of the scores from k on (C2 = (-1 + 0.5·1.5) / 1.5,
# D2 = (-0.25 + 0.5·(-1)) / 1.5); the last turn: its own score
REVIEW_VALUES = [[1.5], [-0.4, 1.0], [0.1875, -1 / 6, 1.5], [-0.8125, -0.5, -1.0]]
# pooled over the nine turns: mean 1.30833 / 9 = 0.14537, population std 0.90939
REVIEW_CENTRED = [[1.35463], [-0.54537, 0.85463], [0.04213, -0.31204, 1.35463], [-0.95787, -0.64537, -1.14537]]
REVIEW_ADVANTAGES = [[1.4896], [-0.59971, 0.93978], [0.04633, -0.34313, 1.4896], [-1.05331, -0.70967, -1.25949]]


def _group(turns: list[tuple[list[float], list[bool]]]) -> Group:
    g = Group(group_id="g", task=TASK, size=len(turns), last_activity=0.0)
    for i, (scores, passed) in enumerate(turns):
        g.episodes[i] = make_episode(
            TASK, "g", i, [TurnSpec(passed=p, score=s) for s, p in zip(scores, passed, strict=True)]
        )
    return g


def test_turn_values_hand_computed():
    for (scores, _), r, expected in zip(REVIEW, REVIEW_R, REVIEW_VALUES, strict=True):
        assert prime_echo(scores, _, **PE) == pytest.approx(r)
        assert turn_values(scores, r, gamma=0.5) == pytest.approx(expected)
    assert turn_values([-1.0, -0.5, 1.2], 0.3, gamma=0.0) == pytest.approx([0.3, -0.5, 1.2])  # own score only
    assert turn_values([-1.0, -0.5, 1.2], 0.3, gamma=1.0) == pytest.approx(
        [0.3, 0.35, 1.2]
    )  # the plain mean of the rest
    assert turn_values([-1.0, -1.0, -1.0], -1.0, gamma=0.5) == [-1.0] * 3  # every turn failed: the floor everywhere
    with pytest.raises(ValueError):
        turn_values([], 0.0, gamma=0.5)


def test_per_turn_credit_of_the_review_group():
    passed = [p for _, p in REVIEW]
    floored = floor_passing_turns(REVIEW_VALUES, passed)
    assert floored == REVIEW_VALUES  # every pass (A1, B2, C3) is above the best failed turn (C1 = 0.1875)
    assert np.mean([v for vs in floored for v in vs]) == pytest.approx(0.14537, abs=1e-5)
    for got, want in zip(pooled_advantages(floored, std_norm=False), REVIEW_CENTRED, strict=True):
        assert got == pytest.approx(want, abs=1e-3)
    advantages = pooled_advantages(floored)
    for got, want in zip(advantages, REVIEW_ADVANTAGES, strict=True):
        assert got == pytest.approx(want, abs=1e-3)
    # the replay credits the group so (the defaults: per-turn credit, γ = 0.5, every turn trains)
    v = judge(_group(REVIEW), AlgoConfig(group_size=4))
    assert v.rewards == pytest.approx(REVIEW_R) and not v.tied
    for got, want in zip(v.advantages, REVIEW_ADVANTAGES, strict=True):
        assert got == pytest.approx(want, abs=1e-3)
    # B's successful repair is pushed up, above every failed turn of the group (episode credit: -0.594)
    failed = [
        a for adv, (_, ps) in zip(v.advantages, REVIEW, strict=True) for a, p in zip(adv, ps, strict=True) if not p
    ]
    assert v.advantages[1][1] > 0 and v.advantages[1][1] > max(failed)


def test_episode_credit_reproduces_one_advantage_per_episode():
    old = [1.58208, -0.59418, 0.07875, -1.06665]  # group_advantages(R): the same advantage on every turn
    assert group_advantages(REVIEW_R).tolist() == pytest.approx(old, abs=1e-4)
    v = judge(_group(REVIEW), AlgoConfig(group_size=4, turn_credit="episode"))
    for got, a, (scores, _) in zip(v.advantages, old, REVIEW, strict=True):
        assert got == pytest.approx([a] * len(scores), abs=1e-4)
    v = judge(_group(REVIEW), AlgoConfig(group_size=4, turn_credit="episode", train_turns="first"))
    assert v.advantages == [pytest.approx([a], abs=1e-4) for a in old]


def test_a_passing_repair_in_a_group_whose_first_turns_all_fail_gets_the_highest_advantage():
    group = [
        ([-1.0, 1.0], [False, True]),  # R -0.4; the repair passes: value 1.0
        ([-0.05, -0.05], [False, False]),  # R -0.05, values (-0.05, -0.05)
        ([-0.5, -0.5], [False, False]),  # R -0.5, values (-0.5, -0.5)
        ([-0.1, -0.25], [False, False]),  # R -0.1375, values (-0.1375, -0.25)
    ]
    v = judge(_group(group), AlgoConfig(group_size=4))
    flat = [a for adv in v.advantages for a in adv]
    assert flat.index(max(flat)) == 1 and sorted(flat)[-2] < v.advantages[0][1]  # strictly the highest
    assert v.advantages[0][1] > 0
    # with one advantage per episode (R mean -0.272) the same repair turn is pushed down, below two failures
    episode = judge(_group(group), AlgoConfig(group_size=4, turn_credit="episode")).advantages
    assert episode[0][1] < 0 and episode[0][1] < episode[1][0] and episode[0][1] < episode[3][0]


def test_the_floor_keeps_every_pass_at_or_above_every_failed_turn_of_its_group():
    # X passes at turn 2, then a performance turn fails: v_2 = (1.0 + 0.5·(-1)) / 1.5 = 1/3. Y's failed turn 2
    # precedes a 3.0 pass: v_2 = (-0.05 + 0.5·3.0) / 1.5 = 0.9667, above X's pass, so the floor lifts X's pass.
    values = [turn_values([-0.05, 1.0, -1.0], 0.3125, gamma=0.5), turn_values([-1.0, -0.05, 3.0], 0.0, gamma=0.5)]
    passed = [[False, True, False], [False, False, True]]
    assert values == [pytest.approx([0.3125, 1 / 3, -1.0]), pytest.approx([0.0, 0.96667, 3.0], abs=1e-5)]
    floored = floor_passing_turns(values, passed)
    assert floored == [pytest.approx([0.3125, 0.96667, -1.0], abs=1e-5), pytest.approx([0.0, 0.96667, 3.0], abs=1e-5)]
    adv = pooled_advantages(floored)
    by_pass = [(a, p) for aa, pp in zip(adv, passed, strict=True) for a, p in zip(aa, pp, strict=True)]
    assert min(a for a, p in by_pass if p) >= max(a for a, p in by_pass if not p)
    # the replay floors so: these are X's and Y's PrimeEcho rewards
    group = [([-0.05, 1.0, -1.0], passed[0]), ([-1.0, -0.05, 3.0], passed[1])]
    credited = judge(_group(group), AlgoConfig(group_size=2)).advantages
    assert credited == [pytest.approx(adv[0]), pytest.approx(adv[1])]
    # without the floor X's pass would sit below Y's failed turn
    raw = pooled_advantages(values)
    assert raw[0][1] < raw[1][1]
    # a group with no failed turn, or no pass, is left as it is
    assert floor_passing_turns([[1.2], [1.0]], [[True], [True]]) == [[1.2], [1.0]]
    assert floor_passing_turns([[-1.0], [-0.5]], [[False], [False]]) == [[-1.0], [-0.5]]


def test_a_group_ties_when_its_credited_values_do():
    # equal rewards (R = -0.875 each) but different repair turns: a signal per turn, none per episode
    group = [([-1.0, -0.5, -1.0], [False] * 3), ([-1.0, -1.0, -0.5], [False] * 3)]
    assert not judge(_group(group), AlgoConfig(group_size=2)).tied
    assert judge(_group(group), AlgoConfig(group_size=2, turn_credit="episode")).tied
    assert judge(_group(group), AlgoConfig(group_size=2, train_turns="first")).tied  # only turn 1 is credited
    same = [([-1.0, -1.0], [False] * 2)] * 2  # every value -1
    v = judge(_group(same), AlgoConfig(group_size=2))
    assert v.tied and v.advantages == [[0.0, 0.0], [0.0, 0.0]]
    # attempts that fail every turn tie whatever their lengths: the middle turns are not trained down
    # for their position (a discounted sum would value them -1.5 against -1)
    longer = [([-1.0, -1.0, -1.0], [False] * 3), ([-1.0, -1.0], [False] * 2), ([-1.0], [False])]
    assert judge(_group(longer), AlgoConfig(group_size=3)).tied


@pytest.mark.parametrize(
    "turn_credit, train_turns, expected", [("per_turn", "all", 2), ("episode", "all", 0), ("per_turn", "first", 0)]
)
def test_turns_with_own_credit(turn_credit, train_turns, expected):
    ep = make_episode(TASK, "g", 0, [TurnSpec(), TurnSpec(), TurnSpec(passed=True, score=1.0)])
    assert turns_with_own_credit(ep, AlgoConfig(turn_credit=turn_credit, train_turns=train_turns)) == expected
