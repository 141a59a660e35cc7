"""`kiln bench`: the loop's throughput against each stage's own capacity, in one invocation.

    kiln bench CONFIG [section.key=value ...] [--eta 1 2] [--warmup 2] [--steps 4] [--out DIR]
    kiln bench CONFIG --no-stages --eta 1 --no-sync --kill rollout-0@2     one run with a fault

(a) Each stage alone on the run's own model and workload (launch/bench/stages.py): the engine's
decoded tok/s at `rollout.max_batch` (the torch engine's beside plain HF `generate` on the same model
and prompts, and beside the bound its decode step's memory traffic sets), the verifiers'
verifications per minute on the run's candidate mix, the learner's step time on a batch of the run's
shape, the weight-sync time.
(b) The loop (`kiln train`, the same code and workload) at η = 0 and at each `--eta` (η ≥ 1; default
1 and 2), only `algo.max_staleness` changed: `--warmup` steps, then `--steps` measured ones
(launch/bench/train.py). Every loop run starts with an empty verifier cache (so it compiles what a
fresh run compiles) and without evaluations.

Reported (launch/bench/report.py): samples/s; decoded, trained and gradient tok/s; each actor's busy
share from the spans it records (RUN_DIR/timeline.jsonl) and its occupancy against its capacity
alone; each actor's CPU share (its process tree's CPU time; on Linux); the ideal-overlap bound and
each run's fraction of it; the async/sync speedup, the staleness histogram and the weight-sync
p50/p99. Written: the table on stdout and in OUT/report.md, OUT/bench.json, and OUT/gantt.png (one
row per actor: generating / verifying / training / syncing, waiting in grey).

`--kill ACTOR@STEP` kills an actor in every loop run once the learner recorded STEP (the kill ->
next step time is reported); `--stop-after S` ends each loop run at its first step S seconds in
(from step 2), for a wall-clock budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from configs import KilnConfig, load_config
from launch.driver.run_dir import RunDirectory

log = logging.getLogger(__name__)

DATE_FORMAT = "%Y-%m-%d"


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure the loop against each stage's own capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG [section.key=value ...]",
        help="the YAML preset (or --config), then config overrides",
    )
    p.add_argument("--config", metavar="FILE", help="the YAML preset (instead of the first argument)")
    p.add_argument(
        "--eta",
        type=int,
        nargs="+",
        default=[1, 2],
        metavar="N",
        help="η (algo.max_staleness) of the asynchronous runs (default: 1 2)",
    )
    p.add_argument("--no-sync", action="store_true", help="skip the η = 0 run")
    p.add_argument(
        "--no-async",
        action="store_true",
        help="skip the asynchronous runs (only η = 0: the sync baseline alone, where one run is what fits a budget)",
    )
    p.add_argument("--no-stages", action="store_true", help="skip the measurements of each stage alone")
    p.add_argument("--no-loops", action="store_true", help="measure each stage alone only")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="learner steps before the window (default 2)")
    p.add_argument("--steps", type=int, default=4, metavar="S", help="learner steps measured (default 4)")
    p.add_argument("--kill", metavar="ACTOR@STEP", help="kill this actor once the learner recorded STEP")
    p.add_argument(
        "--chaos",
        type=int,
        metavar="N",
        help="instead of the benchmark: one run killed N times, every role in turn, the driver included "
        "(SIGKILL and SIGTERM; the driver followed by --resume); reports each recovery and the no-loss check",
    )
    p.add_argument("--seed", type=int, default=0, help="--chaos: the seed of the order of the roles killed")
    p.add_argument(
        "--stop-after",
        metavar="SECONDS",
        type=float,
        help="end each loop run at its first step this many seconds in (from step 2)",
    )
    p.add_argument("--out", metavar="DIR", help="where the runs and the report go (default: LOGGING.ROOT/bench-TIME)")
    p.add_argument("--json", metavar="FILE", help="also write the report's JSON here")
    p.add_argument("--engine-requests", type=int, metavar="N", help="engine alone: requests (default 2 × max_batch)")
    p.add_argument(
        "--verifier-requests",
        type=int,
        metavar="N",
        help="verifier alone: attempts (default 4 × max_concurrent_requests × num_actors)",
    )
    p.add_argument("--learner-steps", type=int, default=3, metavar="N", help="learner alone: timed steps (default 3)")
    p.set_defaults(func=cmd_bench)


@dataclasses.dataclass(frozen=True)
class Plan:
    config: str | None
    overrides: list[str]
    etas: list[int]
    kill: tuple[str, int] | None
    # Set by cmd_bench, not on the command line: `model.path=DIR` when the config names Kiln's tiny
    # checkpoint, so the stages and every loop run load the one built (or found) under logging.root.
    resolved: list[str] = dataclasses.field(default_factory=list)


def parse(args: argparse.Namespace) -> Plan | str:
    """The bench's plan, or a one-line error."""
    config, overrides = args.config, list(args.args)
    if config is None and overrides and "=" not in overrides[0]:
        config = overrides.pop(0)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        return f"expected section.key=value overrides, got {bad[0]!r}"
    if min(args.eta) < 1:
        return f"--eta takes the asynchronous runs' η >= 1 (η = 0 always runs unless --no-sync), got {args.eta}"
    if args.warmup < 1 or args.steps < 1:
        return "--warmup and --steps must be >= 1 (the first step includes the start-up)"
    for name in ("engine_requests", "verifier_requests", "learner_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    kill = None
    if args.kill:
        actor, _, step = args.kill.rpartition("@")
        if not actor or not step.isdigit():
            return f"--kill wants ACTOR@STEP, got {args.kill!r}"
        kill = (actor, int(step))
    etas = [] if args.no_loops else ([] if args.no_sync else [0]) + ([] if args.no_async else sorted(set(args.eta)))
    if args.no_loops and args.no_stages:
        return "--no-loops and --no-stages leave nothing to measure"
    if not args.no_loops and not etas:
        return "--no-sync and --no-async leave no loop run (--no-loops measures the stages alone)"
    return Plan(config=config, overrides=overrides, etas=etas, kill=kill)


def actor_names(cfg: KilnConfig) -> list[str]:
    from launch.driver.plan import learner_ranks

    return (
        ["replay", "learner"]
        + [f"learner-{r}" for r in range(1, learner_ranks(cfg))]
        + [f"rollout-{i}" for i in range(cfg.rollout.num_actors)]
        + [f"verifier-{i}" for i in range(cfg.verifier.num_actors)]
    )


def cmd_bench(args: argparse.Namespace) -> int:
    plan = parse(args)
    if isinstance(plan, str):
        print(f"kiln bench: {plan}", file=sys.stderr)
        return 2
    base = load_config(plan.config, plan.overrides)  # a bad config fails here, in one line (cli.main)
    if plan.kill is not None and plan.kill[0] not in actor_names(base):
        print(
            f"kiln bench: --kill {plan.kill[0]!r}: no such actor (this config has {', '.join(actor_names(base))})",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=base.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.chaos is not None:
        return _chaos(plan, args)
    from launch.driver.tiny_checkpoint import resolve_model_path

    model_path = resolve_model_path(base).model.path
    if model_path != base.model.path:
        plan.resolved.append(f"model.path={model_path}")
    out = Path(args.out or Path(base.logging.root) / f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    if (out / "bench.json").exists():
        print(f"kiln bench: {out} holds a bench report already; choose another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    report = bench(base, plan, out, args)
    from launch.bench.report import render

    table = render(report)
    print(table)
    (out / "report.md").write_text(table + "\n")
    text = json.dumps(_json_safe(dataclasses.asdict(report)), indent=1)
    (out / "bench.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    print(f"\nkiln bench: report, JSON and Gantt timeline in {out}")
    return 0


def _chaos(plan: Plan, args: argparse.Namespace) -> int:
    from launch.bench.chaos import chaos

    if args.chaos < 1:
        print("kiln bench: --chaos N needs N >= 1 kills", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    if (out / "chaos.json").exists():
        print(f"kiln bench: {out} holds a chaos report already; choose another --out", file=sys.stderr)
        return 2
    result = chaos(str(plan.config), args.chaos, out.resolve(), plan.overrides, args.seed)
    print(f"\nkiln bench: chaos report in {out / 'chaos.json'}")
    return 0 if result.finished and result.id_check.get("ok") and not result.left_at_end else 1


def bench(base: KilnConfig, plan: Plan, out: Path, args: argparse.Namespace):
    from launch.bench.gantt import plot_gantt
    from launch.bench.report import BenchReport, complete
    from launch.bench.stages import measure
    from launch.bench.train import run_loop

    report = BenchReport(
        config=plan.config or "(schema defaults)",
        command=_command(plan, args),
        date=time.strftime(DATE_FORMAT),
        device=describe_device(base),
        load_average=_load_average(),
        stages=None,
        loops=[],
        warmup=args.warmup,
        steps=args.steps,
    )
    if not args.no_stages:
        stages_cfg = load_config(plan.config, plan.overrides + plan.resolved)
        r, v = stages_cfg.rollout, stages_cfg.verifier
        report.stages = measure(
            stages_cfg,
            out / "stages",
            engine_requests=args.engine_requests or 2 * r.max_batch,
            verifier_requests=args.verifier_requests or 4 * v.max_concurrent_requests * v.num_actors,
            learner_steps=args.learner_steps,
        )
    for eta in plan.etas:
        cfg = load_config(
            plan.config,
            plan.overrides
            + plan.resolved
            + [
                f"algo.max_staleness={eta}",
                f"logging.root={out}",
                f"logging.run_name=eta{eta}",
                "logging.live=false",
                f"algo.total_steps={args.warmup + args.steps + 2}",  # past the window: no end-of-run effects inside it
                f"verifier.cache_dir={(out / 'verifier-cache' / f'eta{eta}').resolve()}",
                "eval.every=0",
            ],
        )
        log.info("loop run at η = %d: %d warm-up + %d measured steps", eta, args.warmup, args.steps)
        report.loops.append(
            run_loop(
                cfg,
                RunDirectory.create(cfg),
                warmup=args.warmup,
                steps=args.steps,
                kill=plan.kill,
                stop_after=args.stop_after,
            )
        )
    complete(report, engines=base.rollout.num_actors, batch_sequences=base.algo.batch_groups * base.algo.group_size)
    if report.loops:
        report.gantt = str(
            plot_gantt(
                report.loops,
                out / "gantt.png",
                f"kiln bench {report.config}: what each actor did in the measured window",
            )
        )
    return report


def describe_device(cfg: KilnConfig) -> str:
    import torch

    cpu = f"{os.cpu_count()} CPU cores ({_cpu_model()}), {_memory_gib():.0f} GiB"
    gpus = ""
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}, "
    return f"{gpus}{cpu}; Python {platform.python_version()}, torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def _load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def _command(plan: Plan, args: argparse.Namespace) -> str:
    """The invocation, spelled out with every setting that shapes the figures."""
    words = ["kiln", "bench"] + ([plan.config] if plan.config else []) + plan.overrides
    asynchronous = [str(e) for e in plan.etas if e > 0]
    words += (["--eta", *asynchronous] if asynchronous else ["--no-async"]) + (
        ["--no-sync"] if 0 not in plan.etas else []
    )
    words += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    for flag, value in (
        ("--kill", args.kill),
        ("--stop-after", args.stop_after),
        ("--engine-requests", args.engine_requests),
        ("--verifier-requests", args.verifier_requests),
    ):
        if value is not None:
            words += [flag, str(value)]
    if args.no_loops:
        words.append("--no-loops")
    if args.no_stages:
        words.append("--no-stages")
    elif args.learner_steps != 3:
        words += ["--learner-steps", str(args.learner_steps)]
    return shlex.join(words)


def _json_safe(value):
    """inf and NaN as null: bench.json stays strict JSON."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
