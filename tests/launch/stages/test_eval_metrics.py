"""The evaluation protocol's numbers on a hand-computed set of verdicts (launch/stages/eval/metrics.py)."""

from __future__ import annotations

import pytest

from actors.rollout.evaluation import EvalAttempt
from launch.stages.eval.metrics import is_faster, pass_at_k, summarize


def att(task: str, level: int, passed: bool, eager=None, compile_=None, infra=False, sample=0) -> EvalAttempt:
    error = None if passed else ("infra" if infra else "correctness")
    return EvalAttempt(
        task_id=task,
        level=level,
        sample=sample,
        text="",
        passed=passed,
        stage="perf" if passed else "run",
        error_class=error,
        speedup_eager=eager,
        speedup_compile=compile_,
    )


VERDICTS = [
    # level 1, task A: two passes (1.2x: faster; 1.05x: not faster at 1.1), a failure whose 2.0x does
    # not count, and an infra verdict (excluded, counted): n = 3 usable, c = 2
    att("level1/a", 1, True, eager=1.2),
    att("level1/a", 1, True, eager=1.05),
    att("level1/a", 1, False, eager=2.0),
    att("level1/a", 1, False, infra=True),
    # level 1, task B: three failures: n = 3, c = 0
    att("level1/b", 1, False),
    att("level1/b", 1, False),
    att("level1/b", 1, False),
    # level 2, task C: pass at 1.2x eager / 1.15x compile, pass without timing, failure: n = 3, c = 2
    att("level2/c", 2, True, eager=1.2, compile_=1.15),
    att("level2/c", 2, True),
    att("level2/c", 2, False),
    # level 2, task D: one usable pass and two infra verdicts: n = 1 < k = 2
    att("level2/d", 2, True, eager=0.9, compile_=1.05),
    att("level2/d", 2, False, infra=True),
    att("level2/d", 2, False, infra=True),
]


def test_pass_at_k_estimator_and_threshold():
    assert pass_at_k(3, 2, 1) == pytest.approx(2 / 3)
    assert pass_at_k(3, 2, 2) == 1.0  # C(1, 2) = 0: any two of three include a pass
    assert pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 0, 1) == 0.0
    assert pass_at_k(5, 1, 2) == pytest.approx(1 - 6 / 10)
    assert not is_faster(True, 1.05, 1.1) and is_faster(True, 1.2, 1.1)
    assert not is_faster(False, 2.0, 1.1) and not is_faster(True, None, 1.1)
    assert not is_faster(True, 1.1, 1.1)  # "more than" the threshold
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_hand_computed_table():
    s = summarize(VERDICTS, ks=(1, 2), fast_threshold=1.1)
    l1, l2, overall = s.rows
    assert [r.label for r in s.rows] == ["level 1", "level 2", "Overall"]
    assert s.n == 4  # samples per task, infra ones included

    # Pass@k is per task, averaged over tasks: A = 1 - 1/3, B = 0
    assert l1.pass_at[1] == pytest.approx((2 / 3 + 0) / 2)
    assert l1.pass_at[2] == pytest.approx((1 + 0) / 2)
    # Avg and Faster are per attempt, pooled: 2 of 6 usable attempts passed, one of them above 1.1x
    assert l1.avg == pytest.approx(2 / 6)
    assert l1.faster["eager"] == pytest.approx(1 / 6)  # the 1.2x counts, the 1.05x and the failed 2.0x do not
    assert l1.faster["compile"] == 0.0  # measured somewhere in the evaluation, so 0 here, not missing
    assert (l1.tasks, l1.attempts, l1.passed, l1.infra) == (2, 6, 2, 1)

    assert l2.pass_at[1] == pytest.approx((2 / 3 + 1) / 2)
    assert l2.pass_at[2] == pytest.approx(1.0) and l2.short_of_k == {1: 0, 2: 1}  # D has one usable attempt
    assert l2.avg == pytest.approx(3 / 4)  # pooled per attempt, not the per-task mean (5/6)
    assert l2.faster["eager"] == pytest.approx(1 / 4) and l2.faster["compile"] == pytest.approx(1 / 4)
    assert l2.infra == 2

    # Overall pools every attempt of every level (and every task for Pass@k)
    assert overall.pass_at[1] == pytest.approx((2 / 3 + 0 + 2 / 3 + 1) / 4)
    assert overall.pass_at[2] == pytest.approx((1 + 0 + 1) / 3) and overall.short_of_k[2] == 1
    assert overall.avg == pytest.approx(5 / 10)
    assert overall.faster["eager"] == pytest.approx(2 / 10) and overall.faster["compile"] == pytest.approx(1 / 10)
    assert (overall.tasks, overall.attempts, overall.infra) == (4, 10, 3)

    m = s.metrics()
    assert m["eval/pass@1"] == pytest.approx(7 / 12) and m["eval/avg@4"] == pytest.approx(0.5)
    assert m["eval/level2/faster_compile"] == pytest.approx(0.25)
    assert (m["eval/infra"], m["eval/short_of_2"], m["eval/attempts"]) == (3.0, 1.0, 10.0)


def test_threshold_from_the_command_line_changes_faster():
    s = summarize(VERDICTS, ks=(1,), fast_threshold=1.0)  # now the 1.05x counts too
    assert s.overall.faster["eager"] == pytest.approx(3 / 10)


def test_unmeasured_baseline_and_all_infra():
    s = summarize([att("level1/a", 1, True, eager=1.5), att("level1/a", 1, False)], ks=(1,), fast_threshold=1.1)
    assert s.overall.faster["compile"] is None and s.overall.faster["eager"] == 0.5
    assert "eval/faster_compile" not in s.metrics()
    empty = summarize([att("level1/a", 1, False, infra=True)], ks=(1,), fast_threshold=1.1)
    assert empty.overall.avg is None and empty.overall.pass_at[1] is None and empty.overall.infra == 1


def test_progress_eta_counts_only_this_runs_rate():
    import io

    from launch.stages.eval.progress import Progress, eta_seconds

    assert eta_seconds(0, 10, 5.0) is None and eta_seconds(4, 6, 8.0) == pytest.approx(12.0)
    now = [100.0]
    p = Progress(tasks=3, attempts=10, resumed=4, stream=io.StringIO(), every_s=1e9, clock=lambda: now[0])
    now[0] += 8.0
    p.update(verified=2, tasks_done=2)  # 2 attempts in 8 s here; the 4 resumed took no time here
    assert p.line().endswith("tasks 2/3  attempts 6/10  ETA 00:16")
