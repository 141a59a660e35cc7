"""`kiln rft`: rejection-sampling fine-tuning data from a model's own verified attempts.

    kiln rft --model DIR --tasks DIR --samples N [--max-per-task M] [--keep-repairs] [--exclude DIR ...]
             [--out FILE] [--forced SOLUTIONS_DIR] [--backend cpu|cuda] [--config F] [section.key=value ...]

Samples N attempts per task with Kiln's rollout code (the engine `rollout.engine`, repair turns up to
`rollout.max_turns`), verifies them with Kiln's kernel verifier, keeps the passing first attempts (and
with --keep-repairs the repair dialogues that ended in a pass), deduplicates them by normalised source
and keeps at most M per task, the distinct and fastest first (launch/stages/rft/select.py). Writes FILE (JSONL
chat examples that `kiln sft --data FILE` reads as they are; default rft.jsonl) and FILE.yield.json,
and prints the per-task yield table.

Evaluation tasks are never sampled (launch/stages/decontam.py): the tasks of the validation split of --tasks
(`replay.val_fraction`, `replay.split_seed`), and tasks with the op structure or normalised source of
a validation task or of any task under --exclude. They are counted in the output.

--forced SOLUTIONS_DIR: forced-candidate mode (actors/rollout/forced.py): attempts are drawn from the
shipped solution and its broken variants and scored by the engine, so passing attempts exist on a CPU
machine with a tiny model. Exit status 0 when examples were written, 1 when none passed, 2 on a usage
error (one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from configs import load_config
from launch.observe.words import plural

PROG = "kiln rft"


def add_rft_parser(sub) -> None:
    from launch.config_args import add_config_arguments

    p = sub.add_parser(
        "rft",
        help="verified, deduplicated fine-tuning data from the model's own attempts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="DIR", help="HF checkpoint directory (or kiln:tiny-chat)")
    p.add_argument("--tasks", required=True, metavar="DIR", help="KernelBench-format task directory")
    p.add_argument("--samples", required=True, type=int, metavar="N", help="attempts per task")
    p.add_argument("--max-per-task", type=int, default=4, metavar="M", help="distinct examples kept per task (0 = all)")
    p.add_argument("--keep-repairs", action="store_true", help="also keep repair dialogues that ended in a pass")
    p.add_argument(
        "--exclude",
        nargs="+",
        action="extend",
        default=[],
        metavar="DIR",
        help="task directories (a KernelBench clone, ...) whose tasks are never sampled",
    )
    p.add_argument("--out", default="rft.jsonl", metavar="FILE", help="output JSONL (default rft.jsonl)")
    p.add_argument(
        "--forced", metavar="SOLUTIONS_DIR", help="forced-candidate mode: draw attempts from these solutions"
    )
    p.add_argument("--backend", choices=("cpu", "cuda"), help="verifier backend (default verifier.backend)")
    add_config_arguments(p)
    p.set_defaults(func=cmd_rft)


def fail(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def cmd_rft(args: argparse.Namespace) -> int:
    from actors.policy.chat_data import write_examples
    from launch.driver.tiny_checkpoint import resolve_model_path
    from launch.stages.decontam import eval_tasks
    from launch.stages.rft.sample import LocalVerifierPool, sample_groups
    from launch.stages.rft.select import TaskYield, candidates, choose, yield_table
    from tasks.loader import TaskLoadError, load_tasks
    from tasks.synth.decontam import ExcludeError

    if args.samples < 1 or args.max_per_task < 0:
        return fail("--samples must be at least 1 and --max-per-task at least 0")
    if args.forced and not Path(args.forced).is_dir():
        return fail(f"--forced {args.forced}: no such directory")
    cfg = resolve_model_path(load_config(args.config, [*args.overrides, f"model.path={args.model}"]))
    if not (Path(cfg.model.path) / "config.json").is_file():
        return fail(f"--model {args.model}: not an HF checkpoint directory (no config.json)")
    verifier_cfg = dataclasses.replace(cfg.verifier, backend=args.backend or cfg.verifier.backend)
    try:
        tasks = load_tasks(args.tasks, verifier_cfg.backend)
        evaluation = eval_tasks(cfg.replay, args.tasks, [Path(p) for p in args.exclude])
    except (TaskLoadError, ExcludeError) as err:
        return fail(str(err))
    train = [t for t in tasks if not evaluation.task_drop(t.task_id, t.kernel.reference, t.kernel.source_path)]
    print(evaluation.summary())
    if not train:
        return fail(f"{args.tasks}: every task is an evaluation task; nothing to sample")
    started = time.monotonic()
    rows, kept = [], []
    verifier = LocalVerifierPool(verifier_cfg)
    try:
        for task, episodes in sample_groups(
            train,
            rollout=cfg.rollout,
            model=cfg.model,
            evaluation=cfg.eval,
            samples=args.samples,
            verifier=verifier,
            forced=Path(args.forced) if args.forced else None,
        ):
            row = TaskYield(task.task_id)
            kept += choose(candidates(task, episodes, args.keep_repairs, row), args.max_per_task, row)
            rows.append(row)
            print(
                f"{task.task_id}: {row.passed_first} passed at turn 1, {row.passed_repair} after repair, "
                f"{row.kept} kept",
                file=sys.stderr,
                flush=True,
            )
    finally:
        verifier.close()
    out = write_examples(args.out, [c.example for c in kept])
    summary = {
        "tasks": len(train),
        "samples": args.samples,
        "kept": len(kept),
        "seconds": time.monotonic() - started,
        "decontamination": dict(evaluation.dropped),
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    Path(f"{out}.yield.json").write_text(json.dumps(summary, indent=1))
    print(yield_table(rows))
    print(f"wrote {plural(len(kept), 'example')} to {out} ({summary['seconds']:.0f} s)")
    return 0 if kept else 1
