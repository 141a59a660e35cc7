"""Runs the ablation's trainings: for each arm and seed, the user's config with the user's overrides,
then the arm's, then the run's own (steps, seed, where it writes), trained in this process
(`cluster.use_ray=false`) one after another. Each run keeps its run directory under OUT/runs/."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from configs import KilnConfig, load_config
from launch.stages.ablate.arms import Arm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    config: Path
    overrides: tuple[str, ...]
    seeds: int
    steps: int
    out: Path


def run_overrides(plan: Plan, arm: Arm, seed: int) -> list[str]:
    """The overrides of one run, the later winning: the user's, the arm's, the run's own."""
    return [
        *plan.overrides,
        *arm.overrides,
        "cluster.use_ray=false",
        f"algo.total_steps={plan.steps}",
        f"algo.seed={seed}",
        f"rollout.seed={seed}",
        f"model.seed={seed}",
        f"logging.root={plan.out / 'runs'}",
        f"logging.run_name={arm.name}-seed{seed}",
        "logging.live=false",
    ]


def configs(plan: Plan, arms: list[Arm]) -> dict[tuple[str, int], KilnConfig]:
    """Every run's resolved config, before any starts: a bad override fails here, not mid-ablation."""
    return {
        (arm.name, seed): load_config(plan.config, run_overrides(plan, arm, seed))
        for arm in arms
        for seed in range(plan.seeds)
    }


def run_all(
    plan: Plan, cfgs: dict[tuple[str, int], KilnConfig], train: Callable | None = None
) -> dict[tuple[str, int], list[dict]]:
    """Train every run; its metrics rows by (arm, seed). `train(cfg) -> rows` replaces the real
    training in tests of the orchestration."""
    train = train or train_one
    rows = {}
    for (arm, seed), cfg in cfgs.items():
        log.info("ablate: arm %s, seed %d", arm, seed)
        rows[(arm, seed)] = train(cfg)
    return rows


def train_one(cfg: KilnConfig) -> list[dict]:
    """One in-process training run; its metrics rows."""
    from launch.driver.run_dir import RunDirectory
    from launch.driver.tiny_checkpoint import resolve_model_path
    from launch.driver.train import train
    from launch.observe.metrics import read_metrics

    run = RunDirectory.create(cfg)
    train(resolve_model_path(cfg), run)
    return read_metrics(run.path)
