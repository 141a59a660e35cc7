"""GPU check of `kiln eval`: the shipped CUDA solutions as an answer set, verified on the cuda backend
with the eager and torch.compile baselines timed, and the model-card table printed (for
docs/BENCHMARKS.md). With --variants each solution's broken variants join it (a compile error, a
wrong result, an endless loop, a null write, a PyTorch fallback, a cut-off answer), which must all fail.

    python -m launch.bench.eval_solutions [--out runs/eval/cuda-solutions] [--variants] [section.key=value ...]

Equivalent to:
    python -m launch.stages.eval.answers --tasks tasks --solutions tasks/solutions/cuda --out OUT.jsonl
    kiln eval --answers OUT.jsonl --tasks tasks --backend cuda --k 1 --out OUT verifier.compile_baseline=always
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from configs import ConfigError
from launch.stages.eval.answers import main as write_answers
from launch.stages.eval.cli import add_eval_parser

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.bench.eval_solutions")
    p.add_argument("--out", default="runs/eval/cuda-solutions")
    p.add_argument("--variants", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    answers = out.with_suffix(".jsonl")
    code = write_answers(
        [
            "--tasks",
            str(ROOT / "tasks"),
            "--solutions",
            str(ROOT / "tasks" / "solutions" / "cuda"),
            "--out",
            str(answers),
        ]
        + (["--variants"] if args.variants else [])
    )
    if code:
        return code
    return kiln_eval(
        [
            "--answers",
            str(answers),
            "--tasks",
            str(ROOT / "tasks"),
            "--backend",
            "cuda",
            "--k",
            "1",
            "--out",
            str(out),
            "--name",
            "shipped cuda solutions" + (" + variants" if args.variants else ""),
            "verifier.compile_baseline=always",
            *args.overrides,
        ]
    )


def kiln_eval(argv: list[str]) -> int:
    """`kiln eval ARGV`: the subcommand's own parser and implementation, with the one-line errors of the
    `kiln` entry point (launch/cli/main.py) for what `kiln eval --answers` can raise past its own."""
    parser = argparse.ArgumentParser(prog="kiln")
    add_eval_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(["eval", *argv])
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"kiln: config error: {err}", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError) as err:
        print(f"kiln: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
