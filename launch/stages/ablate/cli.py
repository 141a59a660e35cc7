"""`kiln ablate CONFIG`: the same short training with each mechanism switched off in turn.

    kiln ablate CONFIG [--seeds N] [--steps N] [--arms a,b,...] [--out DIR] [section.key=value ...]

Every arm (launch/stages/ablate/arms.py) runs N seeds in this process, one run after another, with the
arm's overrides on top of CONFIG and the given overrides. OUT gets each run's directory under runs/,
ablation.md (the table, also printed) and one PNG per mechanism (full against the arm without it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from launch.stages.ablate.arms import ArmError, select


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, no exit from inside the parser
        raise _UsageError(message)


def _add_options(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("--seeds", type=int, default=default(2), help="seeds per arm (default 2)")
    p.add_argument("--steps", type=int, default=default(20), help="learner steps per run (default 20)")
    p.add_argument("--arms", default=default(None), help="comma list of arms to run (full always runs); default: all")
    p.add_argument("--out", default=default(None), help="output directory (default runs/ablate-<config name>)")


def add_ablate_parser(sub) -> None:
    p = sub.add_parser(
        "ablate",
        help="train with each mechanism switched off in turn; a table and plots per mechanism",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_options(p, lambda value: value)
    # CONFIG, options and overrides in any order: the rest is parsed again, intermixed, by cmd_ablate
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="CONFIG [section.key=value ...]")
    p.set_defaults(func=cmd_ablate)


def _parse(args: argparse.Namespace) -> argparse.Namespace:
    inner = _Parser(prog="kiln ablate", add_help=False)
    _add_options(inner, lambda value: argparse.SUPPRESS)  # keeps what the outer parser read
    inner.add_argument("config")
    inner.add_argument("overrides", nargs="*")
    return inner.parse_intermixed_args(args.rest, namespace=args)


def cmd_ablate(args: argparse.Namespace) -> int:
    try:
        plan, arms = _plan(args)
    except (_UsageError, ArmError) as err:
        print(f"kiln: ablate: {err}", file=sys.stderr)
        return 2
    return _ablate(plan, arms)


def _plan(args: argparse.Namespace):
    """The ablation the command line asks for: (Plan, arms); _UsageError or ArmError says what is wrong."""
    from launch.stages.ablate.run import Plan

    if not args.rest:
        raise _UsageError("give the config file: kiln ablate CONFIG [options] [section.key=value ...]")
    args = _parse(args)
    config = Path(args.config)
    if not config.is_file():
        raise _UsageError(f"no config file {config}")
    if args.seeds < 1 or args.steps < 1:
        raise _UsageError("--seeds and --steps must be at least 1")
    arms = select(args.arms)
    out = Path(args.out or f"runs/ablate-{config.stem}")
    if (out / "runs").exists():
        raise _UsageError(f"{out} holds an ablation already; give another --out")
    plan = Plan(config=config, overrides=tuple(args.overrides), seeds=args.seeds, steps=args.steps, out=out.resolve())
    return plan, arms


def _ablate(plan, arms) -> int:
    from launch.stages.ablate.plot import plot_mechanism
    from launch.stages.ablate.run import configs, run_all
    from launch.stages.ablate.summary import table

    out = plan.out
    cfgs = configs(plan, arms)  # a bad override fails here (ConfigError: one line, exit 2), before any run
    logging.basicConfig(level=cfgs[("full", 0)].logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = run_all(plan, cfgs)
    results = {a.name: [rows[(a.name, s)] for s in range(plan.seeds)] for a in arms}
    text = table(results, arms, seeds=plan.seeds, steps=plan.steps)
    plots = [
        plot_mechanism(results["full"], results[a.name], a, out / f"{a.name}.png")
        for a in arms
        if a.counter is not None
    ]
    (out / "ablation.md").write_text(text + "".join(f"\n![{p.stem}]({p.name})\n" for p in plots))
    print(text, end="")
    print(f"kiln: ablation table {out / 'ablation.md'}; {len(plots)} plots in {out}")
    return 0
