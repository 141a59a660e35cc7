"""`kiln tasks`: task-set tools. One subcommand so far:

    kiln tasks synth --out DIR --count N --seed S [--ops NAME ...] [--max-ops K] [--exclude DIR ...]
                     [--tasks DIR] [--config F] [section.key=value ...]

writes N KernelBench-format tasks synthesized from random operator graphs (tasks/synth/) to DIR, in
`levelK/` subdirectories, so `replay.tasks=DIR` and `kiln verify --reference DIR/levelK/FILE` read
them. Evaluation tasks are never generated (launch/stages/decontam.py): graphs matching a task under
--exclude or a task of the validation split of --tasks (default `replay.tasks`, split by
`replay.val_fraction` / `replay.split_seed`) are dropped and counted. It prints the mix (levels, op families) and the rejection counts; exit status 0 when all N
were written, 1 when the op set ran out of distinct graphs first, 2 on a bad argument (one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.observe.words import plural

PROG = "kiln tasks synth"


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line naming the problem (no usage dump), exit status 2."""

    def error(self, message: str):
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def add_tasks_parser(sub) -> None:
    p = sub.add_parser("tasks", help="task-set tools: `kiln tasks synth` generates tasks from operator graphs")
    p.set_defaults(func=_no_subcommand)
    tasks = p.add_subparsers(dest="tasks_command", metavar="TASKS_COMMAND", parser_class=OneLineParser)
    s = tasks.add_parser("synth", prog=PROG, help="synthesize KernelBench-format tasks from random operator graphs")
    s.add_argument("--out", metavar="DIR", help="output directory (absent or empty)")
    s.add_argument("--count", type=int, metavar="N", help="number of tasks to write")
    s.add_argument("--seed", type=int, metavar="S", help="random seed: the same seed writes byte-identical files")
    s.add_argument(
        "--ops",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME",
        help="op families or op names to draw from (default: all); commas also separate names",
    )
    s.add_argument("--max-ops", type=int, default=6, metavar="K", help="most ops per graph (default 6)")
    s.add_argument(
        "--exclude",
        nargs="+",
        action="extend",
        default=[],
        metavar="DIR",
        help="task directories (a KernelBench clone, a validation split) whose graphs are dropped",
    )
    s.add_argument(
        "--tasks", metavar="DIR", help="task set whose validation split is excluded too (default replay.tasks)"
    )
    from launch.config_args import add_config_arguments

    add_config_arguments(s)
    s.set_defaults(func=cmd_synth)


def _no_subcommand(args: argparse.Namespace) -> int:
    print("kiln tasks: give a subcommand: synth", file=sys.stderr)
    return 2


def cmd_synth(args: argparse.Namespace) -> int:
    from tasks.synth import SynthConfig, SynthError, synthesize
    from tasks.synth.decontam import ExcludeError
    from tasks.synth.ops import OpSelectionError

    missing = [
        flag for flag, value in (("--out", args.out), ("--count", args.count), ("--seed", args.seed)) if value is None
    ]
    if missing:
        print(f"{PROG}: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    from configs import load_config
    from launch.stages.decontam import validation_files

    ops = tuple(name for entry in args.ops for name in entry.split(",") if name)
    try:
        validation = [tf.path for tf in validation_files(load_config(args.config, args.overrides).replay, args.tasks)]
        cfg = SynthConfig(
            out=Path(args.out),
            count=args.count,
            seed=args.seed,
            ops=ops,
            max_ops=args.max_ops,
            exclude=(*(Path(p) for p in args.exclude), *validation),
        )
        report = synthesize(cfg)
    except (SynthError, OpSelectionError, ExcludeError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    print("\n".join(report.summary()))
    if not report.complete:
        print(
            f"{PROG}: wrote only {len(report.tasks)} of {plural(cfg.count, 'task')} in "
            f"{plural(report.attempts, 'attempt')}: the op "
            "set admits too few distinct graphs that pass the checks (widen --ops or --max-ops)",
            file=sys.stderr,
        )
        return 1
    return 0
