"""The `kiln` command. Each subcommand lives in its own module and registers here once it works.

Every subcommand that reads a config takes `--config FILE` and trailing `section.key=value`
overrides, resolved by `configs.load_config`. Errors print one line and exit non-zero; so do Ctrl-C
and SIGTERM (one line, exit status 130), after `kiln train` has checkpointed and stopped.

Run as the process's own command (`kiln ...`, `python -m launch.cli ...`: main() without argv), the
process is the driver of everything it starts: SIGTERM becomes a KeyboardInterrupt
(launch/driver/stop_signal.py), and a lifeline keeper ends every process it started once it is gone,
however it went (launch/driver/lifeline.py). main(argv) called in-process (tests) does neither.
"""

from __future__ import annotations

import argparse
import os
import sys

from configs import ConfigError, load_config, to_yaml
from launch.config_args import add_config_arguments
from launch.driver import lifeline
from launch.driver.checks import StartupError
from launch.driver.stop_signal import stop_on_sigterm


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config (or the configuration reference as Markdown)."""
    if args.markdown:
        from launch.cli.config_doc import render_markdown

        print(render_markdown(), end="")
        return 0
    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: asynchronous RL for native GPU kernels")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("config", help="print the resolved config after presets and overrides")
    add_config_arguments(p)
    p.add_argument("--markdown", action="store_true", help="print the configuration reference instead")
    p.set_defaults(func=cmd_config)

    from launch.bench.bench import add_bench_parser
    from launch.driver.train import add_train_parser
    from launch.serve.cli import add_serve_parser
    from launch.stages.ablate.cli import add_ablate_parser
    from launch.stages.eval.cli import add_eval_parser
    from launch.stages.export import add_export_parser
    from launch.stages.rft.cli import add_rft_parser
    from launch.stages.sft.cli import add_sft_parser
    from launch.stages.tasks import add_tasks_parser
    from launch.stages.verify import add_verify_parser

    add_train_parser(sub)
    add_verify_parser(sub)
    add_tasks_parser(sub)
    add_export_parser(sub)
    add_bench_parser(sub)
    add_eval_parser(sub)
    add_rft_parser(sub)
    add_sft_parser(sub)
    add_ablate_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is not None:  # called in-process: the caller owns the process, its signals and its children
        return _run(args)
    stop_on_sigterm()
    with lifeline.held():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except ConfigError as err:
        print(f"kiln: config error: {err}", file=sys.stderr)
        return 2
    except StartupError as err:
        for finding in err.findings:
            if finding.level != "note":
                print(finding.line(), file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError) as err:
        print(f"kiln: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kiln ... | head`: the reader left; say so once and stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("kiln: output closed early (broken pipe); the rest was not written", file=sys.stderr)
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
