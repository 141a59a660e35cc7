"""The reward ladder (actors/verifier/reward.py), one test per rung, hand-computed; the verified share q
of a run stopped early (outcome.py); the pass feedback a performance turn reads. Pure: no processes."""

from __future__ import annotations

import pytest

from actors.verifier.outcome import RunOutcome, TrialRecord
from actors.verifier.reward import chosen_speedup, moore_score, pass_feedback
from configs.verifier import RewardConfig

CFG = RewardConfig(lam=0.5, nu_max=2.0, baseline="eager")


def trials(passed: int, failed: int = 0) -> list[TrialRecord]:
    return [TrialRecord(f"primary#{i}", "(8,)", i < passed) for i in range(passed + failed)]


def test_extract_and_cheating_are_the_floor_whatever_q():
    for cls in ("extract", "cheating"):
        for q in (0.0, 0.5, 1.0):
            assert moore_score(CFG, cls, q, 3.0) == -1.0


def test_a_failure_that_verified_nothing_is_the_floor():
    for cls in ("compile", "runtime", "timeout", "correctness"):
        assert moore_score(CFG, cls, 0.0, None) == -1.0


def test_below_a_pass_the_score_grows_only_with_the_verified_share():
    for cls in ("compile", "runtime", "timeout", "correctness"):
        assert moore_score(CFG, cls, 0.2, None) == pytest.approx(-0.4)
        assert moore_score(CFG, cls, 0.6, None) == pytest.approx(-0.2)
        assert moore_score(CFG, cls, 0.6, 5.0) == pytest.approx(-0.2)  # a speed says nothing below a pass
    # every trial passed, then the timed stage raised or hung: 0, below every pass
    assert moore_score(CFG, "timeout", 1.0, None) == 0.0


def test_a_run_stopped_early_scores_as_failing_the_trials_it_never_reached():
    # 5 trials planned; 3 verified correct, then a runtime error (or a timeout) stopped the run
    stopped = RunOutcome(error_class="runtime", trials=trials(3), planned=5)
    wrong = RunOutcome(error_class="correctness", trials=trials(3, failed=2), planned=5)
    assert stopped.q == wrong.q == pytest.approx(0.6)
    assert moore_score(CFG, "runtime", stopped.q, None) == moore_score(CFG, "correctness", wrong.q, None)
    assert moore_score(CFG, "timeout", stopped.q, None) == pytest.approx(-0.2)
    assert RunOutcome(error_class="runtime", planned=5).q == 0.0  # raised on the first trial: the floor
    # a run that judged every trial it posed (a family trial the reference could not take is not planned)
    assert RunOutcome(trials=trials(4), planned=4).q == 1.0


def test_a_pass_earns_a_speed_bonus_over_eager_capped_by_nu_max():
    assert moore_score(CFG, None, 1.0, 0.5) == 1.0  # slower than eager: no bonus, no penalty
    assert moore_score(CFG, None, 1.0, None) == 1.0  # speed unknown
    assert moore_score(CFG, None, 1.0, 2.0) == pytest.approx(1.5)
    assert moore_score(CFG, None, 1.0, 50.0) == pytest.approx(2.0)  # bonus capped at λ·ν_max
    assert moore_score(CFG, None, 0.75, 3.0) == pytest.approx(-0.125)  # a "pass" short of q = 1 is partial


def test_infra_is_zero_and_an_unknown_class_has_no_rung():
    assert moore_score(CFG, "infra", 0.0, None) == 0.0
    with pytest.raises(ValueError, match="no rung"):
        moore_score(CFG, "mystery", 1.0, 2.0)


def test_the_bonus_is_against_the_configured_baseline():
    assert chosen_speedup(RewardConfig(baseline="compile"), 2.0, 1.2) == 1.2
    assert chosen_speedup(RewardConfig(baseline="compile"), 2.0, None) == 2.0
    assert chosen_speedup(RewardConfig(baseline="eager"), 2.0, 1.2) == 2.0


def test_pass_feedback_gives_the_candidates_time_and_each_baselines():
    text = pass_feedback(2e-3, 2.1e-3, 1.5e-3, 1.05, "eager", [], False)
    assert "Time per call: your kernel 2.000 ms, eager PyTorch 2.100 ms, torch.compile 1.500 ms." in text
    assert "Speedup 1.05x vs eager PyTorch, 0.75x vs torch.compile." in text
    eager_only = pass_feedback(2e-3, 1e-3, None, 0.5, "eager", [], False)
    assert "torch.compile" not in eager_only and "Slower than the eager baseline" in eager_only
