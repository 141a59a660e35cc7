"""`kiln train`: the asynchronous training run end to end.

    kiln train [--config F] [section.key=value ...]      a new run
    kiln train --resume RUN_DIR                          continue a run (config from RUN_DIR)
    kiln train --dry-run ...                             run the start-up checks, print the plan, start nothing
    kiln train --rollout-only ...                        episodes to disk, no learner
    kiln train --train-only EPISODES_DIR ...             train on saved episodes, no rollouts

Before anything starts, the start-up checks (launch/driver/checks.py) look at the model, the task set, the
reward actor and the run root; each problem is one line and a non-zero exit. On a Ray cluster the
components' checks run where Ray places the components, once the cluster is joined.

The driver starts the actors (Ray, or in-process with `cluster.use_ray=false`), then only watches:
the actors do the work (rollouts pull tasks from replay, the learner pulls batches and pushes
weights). Synchronous (η = 0) and asynchronous (η ≥ 1) runs are the same code; `algo.max_staleness`
chooses. Ctrl-C checkpoints the learner and stops cleanly; `--resume` continues from there (the
learner restores itself: its run directory says it announced versions before).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from configs import KilnConfig, load_config
from launch.driver.plan import PlacementPlan
from launch.driver.run_dir import RunDirectory
from launch.driver.session import Session

log = logging.getLogger(__name__)


def train(
    cfg: KilnConfig,
    run: RunDirectory,
    *,
    placement: PlacementPlan | None = None,
    on_step: Callable[[Session, int], None] | None = None,
) -> Path:
    """Run until `algo.total_steps` learner steps (or `algo.stop_after_no_progress_s` without one);
    returns the report's path. `on_step(session, step)` runs after each recorded step (custom logic:
    extra logging, fault injection in tests)."""
    with Session(cfg, run, placement) as s:
        s.check_components()  # on a Ray cluster: where each component runs (a local run checked already)
        s.start_replay_and_verifiers()
        s.start_learner()  # restores or warm-starts, publishes its version, starts training
        s.start_rollouts()
        try:
            while not s.learner_finished() and not s.no_progress_stop():
                for step, values in s.monitor.poll(timeout_s=1.0, until=s.supervisor.end_seen, to_step=True):
                    s.record_step(step, values)
                    if s.evaluation_due(step):
                        s.evaluate(step)
                    if on_step is not None:
                        on_step(s, step)
                s.watch_progress()  # rollout-side progress rows, and the no-progress warning
                s.watch_stall()  # no step for far longer than steps take: who waits for what
                s.supervise()
        except KeyboardInterrupt:
            log.warning("interrupted: checkpointing the learner; `kiln train --resume %s` continues", run.path)
            s.checkpoint()
            raise
        s.supervisor.settle()  # a replacement still starting (Ray) is needed by the final evaluation
        s.drain_metrics()
        if s.stopped_for_no_progress:
            s.checkpoint()  # what --resume continues from; the final evaluation would measure untrained weights
        s.export_final()
        if not s.stopped_for_no_progress:
            s.evaluate(s.last_step, final=True)
        s.write_summary()
        return s.write_report()


def rollout_only(cfg: KilnConfig, run: RunDirectory, placement: PlacementPlan | None = None) -> Path:
    """Generate and verify `total_steps · batch_groups` groups with the initial weights and save every
    episode under RUN_DIR/episodes_log/ (for `--train-only`). No learner advances the admission bound,
    so replay admits the whole run at once."""
    cfg = dataclasses.replace(cfg, replay=dataclasses.replace(cfg.replay, admission="whole_run"))
    with Session(cfg, run, placement) as s:
        s.check_components()
        s.start_replay_and_verifiers()
        s.start_rollouts(follow_learner=False, episode_log=True)
        while not s.rollouts_done(cfg.algo.total_steps * cfg.algo.batch_groups):
            s.monitor.poll(timeout_s=1.0, until=s.supervisor.end_seen)
            s.watch_progress()
            s.supervise()
        return run.episode_log


def train_only(cfg: KilnConfig, run: RunDirectory, episodes: Path, placement: PlacementPlan | None = None) -> Path:
    """Train on episodes saved by `--rollout-only`: an offline replay serves their batches. The mode
    exercises the learner alone on fixed input, so there is no warm start (and no evaluation)."""
    cfg = dataclasses.replace(cfg, warm_start=dataclasses.replace(cfg.warm_start, steps=0))
    with Session(cfg, run, placement) as s:
        s.check_components()
        s.start_offline_replay(episodes)
        s.start_learner()
        while not s.learner_finished():
            for step, values in s.monitor.poll(timeout_s=1.0, until=s.supervisor.end_seen, to_step=True):
                s.record_step(step, values)
            s.supervise()
        s.drain_metrics()
        s.export_final()
        return s.write_report()


# ------------------------------------------------------------------------------------------ CLI


def add_train_parser(sub) -> None:
    from launch.config_args import add_config_arguments

    p = sub.add_parser(
        "train",
        help="run asynchronous RL training (the product's main job)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the start-up checks, resolve the placement plan, print, exit (starts nothing)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rollout-only", action="store_true", help="write episodes to disk; no learner")
    mode.add_argument("--train-only", metavar="EPISODES_DIR", help="train on episodes saved by --rollout-only")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    if args.resume:
        run = RunDirectory.open(Path(args.resume))
        cfg = load_config(run.config_path, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
        run = None
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from launch.driver.checks import errors, local_checks
    from launch.driver.plan import PlanError, plan, render
    from launch.driver.tiny_checkpoint import resolve_model_path

    saved, cfg = cfg, resolve_model_path(cfg)  # the run directory keeps `kiln:tiny-chat`, rebuilt if gone
    # A local run's components run here; on a cluster they are checked where they run (Session).
    findings = local_checks(cfg, dry_run=args.dry_run, with_components=args.dry_run or cfg.cluster.address is None)
    for finding in findings:
        if finding.level != "note":
            print(finding.line(), file=sys.stderr)
        elif args.dry_run:
            print(finding.line())
    if errors(findings):
        return 2

    gpus, memory = cfg.cluster.num_gpus, cfg.cluster.gpu_memory_gb
    if not args.dry_run and cfg.cluster.address is None:  # a local run: check against this machine
        from launch.driver.plan import local_gpus

        visible, visible_gb = local_gpus()
        gpus = visible if gpus is None else gpus
        memory = visible_gb if memory is None else memory
    try:  # an infeasible layout fails here, before anything starts
        placement = plan(cfg, gpus_available=gpus, gpu_memory_gb=memory)
    except PlanError as err:
        print(f"kiln: infeasible placement: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(render(placement))
        return 0
    run = run or RunDirectory.create(saved)
    print(f"kiln: run directory {run.path}")
    if args.rollout_only:
        print(f"kiln: episodes in {rollout_only(cfg, run, placement)}")
    elif args.train_only:
        print(f"kiln: report {train_only(cfg, run, Path(args.train_only), placement)}")
    else:
        report = train(cfg, run, placement=placement)
        wall = json.loads((run.path / "summary.json").read_text()).get("wall_s")  # report.md's wall time
        print(f"kiln: finished in {wall:.0f} s; report {report}")
    return 0
