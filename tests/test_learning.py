"""Learning, shown: with the example reward actor (configs/examples/text_match.yaml), a tiny model's
reward rises within a minute of CPU training, over two seeds, while the same run at learning rate 0
stays flat. The control is what makes the rise evidence: same tasks, same sampling, no updates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from configs import load_config
from launch.metrics import read_metrics
from launch.run_dir import RunDirectory
from launch.train import train

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "examples" / "text_match.yaml"
STEPS = 40
WINDOW = 10


def reward_change(tmp_path: Path, name: str, seed: int, lr: float) -> float:
    cfg = load_config(CONFIG, [
        f"logging.root={tmp_path}", f"logging.run_name={name}", "logging.live=false", "logging.episodes_per_step=0",
        "cluster.use_ray=false", f"algo.total_steps={STEPS}", f"learner.lr={lr}",
        # a stationary task mix: no repair tasks from the retry buffer
        "replay.retry.probability=0.0",
        f"model.seed={seed}", f"rollout.seed={seed}", f"algo.seed={seed}", f"replay.split_seed={seed}"])
    run = RunDirectory.create(cfg)
    train(cfg, run)
    rewards = [r["reward/mean"] for r in read_metrics(run.path) if "reward/mean" in r]
    # A step trained on groups that were already buffered has no new group report, hence no reward
    # row; the two windows below need 2·WINDOW rows that do not overlap.
    assert len(rewards) >= 2 * WINDOW + 10, (run.path, len(rewards))
    return float(np.mean(rewards[-WINDOW:]) - np.mean(rewards[:WINDOW]))


@pytest.mark.slow
def test_reward_rises_with_learning_and_stays_flat_without(tmp_path):
    rises = [reward_change(tmp_path, f"seed{s}", s, lr=1e-2) for s in (0, 1)]
    control = reward_change(tmp_path, "control", 0, lr=0.0)
    assert abs(control) < 0.03, f"lr=0 must stay flat, moved {control:+.3f}"
    for rise in rises:
        # measured 2026-11-22: rises +0.051 and +0.083, control -0.001
        assert rise > 0.03 and rise > control + 0.03, f"reward rise {rises} vs control {control:+.3f}"
