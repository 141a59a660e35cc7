"""The forced-candidate pool (`rollout.forced_candidates`): the variants it builds from a shipped
solution, `rollout.forced_mix`, which weighs them, and `rollout.forced_fraction`, which leaves a share
of the attempts to the sampler. (That every task's hang variant compiles and times out is what the
demo's test sees: tests/launch/driver/test_demo.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.buffer.task_source import load_task_set
from actors.rollout.forced import CRASH, SPIN, CandidatePool, candidates, variants
from configs import ConfigError, ReplayConfig, load_config
from configs.rollout import FORCED_VARIANTS

ROOT = Path(__file__).resolve().parents[2]
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


def test_each_variant_is_the_mechanical_edit_its_name_says(task):
    texts = variants(task, SOLUTIONS)
    solution = texts["solution"]
    assert set(texts) <= set(FORCED_VARIANTS) and {"solution", "compile_error", "fallback", "cut_off", "hang"} <= set(
        texts
    )
    assert solution.count(";") - texts["compile_error"].count(";") == 1  # one terminator gone
    assert texts["hang"].replace("\n    " + SPIN, "", 1) == solution  # the spin loop, inserted once
    assert texts["crash"].replace("\n    " + CRASH, "", 1) == solution  # the null write, inserted once
    assert "class ModelNew(" in texts["fallback"] and "load_inline" not in texts["fallback"]
    assert texts["cut_off"].count("```") == 1  # an unclosed fence: nothing to extract


def test_forced_mix_weighs_the_draws(task):
    texts = variants(task, SOLUTIONS)
    pool = CandidatePool(SOLUTIONS, seed=1, mix={"solution": 3.0, "hang": 1.0})  # the others weigh 0
    draws = [pool.draw(task) for _ in range(400)]
    assert set(draws) == {texts["solution"], texts["hang"]}
    assert 250 <= draws.count(texts["solution"]) <= 350  # 3 : 1
    with pytest.raises(ConfigError, match="unknown variant.*spin"):
        CandidatePool(SOLUTIONS, seed=1, mix={"spin": 1.0})
    with pytest.raises(ConfigError, match="nothing to draw"):
        CandidatePool(SOLUTIONS, seed=1, mix={"hang": 0.0})


def test_an_unknown_variant_in_the_config_is_one_line_at_load():
    with pytest.raises(ConfigError, match="rollout.forced_mix: unknown variant.*hangs.*the variants are solution"):
        load_config(ROOT / "configs" / "default.yaml", ["rollout.forced_mix.hangs=1"])
    with pytest.raises(ConfigError, match="rollout.forced_mix: weights must be >= 0"):
        load_config(ROOT / "configs" / "default.yaml", ["rollout.forced_mix.hang=-1"])
