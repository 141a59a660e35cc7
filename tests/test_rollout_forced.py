"""The forced-candidate pool (`rollout.forced_candidates`): the variants it builds from a shipped
solution, and `rollout.forced_fraction`, which leaves a share of the attempts to the sampler."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.buffer.task_source import load_task_set
from actors.rollout.forced import CandidatePool, candidates
from configs import ReplayConfig

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "tasks" / "solutions" / "cpu"


@pytest.fixture(scope="module")
def task():
    tasks = load_task_set(ReplayConfig(tasks=str(ROOT / "tasks"), val_fraction=0.0), "cpu").train
    return next(t for t in tasks if candidates(t, SOLUTIONS))


def test_the_pool_holds_the_solution_and_its_variants(task):
    pool = candidates(task, SOLUTIONS)
    assert len(pool) == len(set(pool)) >= 4  # solution, compile-broken or wrong-result, fallback, cut-off
    assert any("class ModelNew(" in c and "load_inline" not in c for c in pool)  # the PyTorch fallback
    assert sum(c.count("```") == 1 for c in pool) == 1  # exactly one is cut off (unclosed fence)


@pytest.mark.parametrize("fraction, low, high", [(1.0, 400, 400), (0.0, 0, 0), (0.5, 160, 240)])
def test_forced_fraction_leaves_the_rest_to_the_sampler(task, fraction, low, high):
    pool = CandidatePool(SOLUTIONS, seed=3, fraction=fraction)
    forced = sum(pool.draw(task) is not None for _ in range(400))
    assert low <= forced <= high
