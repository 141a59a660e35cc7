"""`kiln sft`: supervised fine-tuning of a checkpoint on chat examples.

    kiln sft --model DIR --data FILE.jsonl|DIR [--epochs E] [--lr LR] [--batch-tokens T]
             [--eval-fraction F] [--eval-every S] [--export-every S] [--checkpoint-every S]
             [--out DIR] [--backend torch|megatron] [--tasks DIR] [--exclude DIR ...] [--seed S]
             [--config F] [section.key=value ...]

The data is JSONL chat examples (actors/policy/chat_data.py; `kiln rft` writes them); the loss falls
on assistant tokens only. Examples of evaluation tasks are dropped and counted (launch/stages/decontam.py:
the validation split of `--tasks`, default `replay.tasks`, under `replay.val_fraction` /
`replay.split_seed`, and every task under `--exclude`). The loop is launch/stages/sft/run.py. Running again
with the same `--out` resumes from its latest checkpoint. A bad data line, a missing model or an
unknown backend is one line on stderr and exit status 2.

Shown while it runs: a progress bar on a terminal (else a line every twentieth of the run),
OUT/metrics.jsonl, TensorBoard events in OUT/tb/ when the tensorboard package is importable (without
it the run says so once and logs to metrics.jsonl only), and at the end OUT/report.md with the loss
curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Self

from configs import load_config
from protocols import metric_keys as mk

PROG = "kiln sft"
SETTINGS_FILE = "sft_settings.json"  # what a resumed run must agree with


def add_sft_parser(sub) -> None:
    from launch.config_args import add_config_arguments

    p = sub.add_parser(
        "sft",
        help="supervised fine-tuning on chat examples (JSONL), with an HF export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="DIR", help="HF checkpoint directory (or kiln:tiny-chat)")
    p.add_argument(
        "--data", required=True, metavar="FILE|DIR", help="a JSONL file of chat examples, or a directory of them"
    )
    p.add_argument("--epochs", type=int, default=1, help="passes over the training examples (default 1)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate, constant (default 1e-5)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per packed batch = one step (default 16384)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of examples held out for the held-out loss")
    p.add_argument("--eval-every", type=int, default=0, help="steps between held-out losses (default: each epoch end)")
    p.add_argument(
        "--export-every", type=int, default=0, help="steps between HF exports under OUT/exports/ (0 = final only)"
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0 = at exports and epoch ends)"
    )
    p.add_argument(
        "--out", metavar="DIR", help="output directory; an existing one is resumed (default runs/sft-<time>)"
    )
    p.add_argument("--backend", choices=("torch", "megatron"), help="learner backend (default learner.backend)")
    p.add_argument("--tasks", metavar="DIR", help="task set whose validation split is excluded (default replay.tasks)")
    p.add_argument(
        "--exclude",
        nargs="+",
        action="extend",
        default=[],
        metavar="DIR",
        help="task directories whose tasks' examples are dropped (a KernelBench clone, ...)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the shuffle")
    add_config_arguments(p)
    p.set_defaults(func=cmd_sft)


def fail(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def cmd_sft(args: argparse.Namespace) -> int:
    from actors.policy.chat_data import DataError
    from actors.policy.tokenizer import load_tokenizer
    from launch.driver.tiny_checkpoint import resolve_model_path
    from launch.stages.decontam import eval_tasks
    from launch.stages.sft.data import load_sft_data
    from launch.stages.sft.run import SFTSettings
    from tasks.synth.decontam import ExcludeError

    problem = _check_numbers(args)
    if problem:
        return fail(problem)
    overrides = [*args.overrides, f"model.path={args.model}"]
    if args.backend:
        overrides.append(f"learner.backend={args.backend}")
    cfg = resolve_model_path(load_config(args.config, overrides))
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        return fail(f"--model {args.model}: not an HF checkpoint directory (no config.json)")
    out = Path(args.out) if args.out else Path(cfg.logging.root) / time.strftime("sft-%Y%m%d-%H%M%S")
    settings = SFTSettings(
        out=out,
        epochs=args.epochs,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        eval_every=args.eval_every,
        export_every=args.export_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
    )
    problem = _check_resume(out, args)
    if problem:
        return fail(problem)
    try:
        evaluation = eval_tasks(cfg.replay, args.tasks, [Path(p) for p in args.exclude], trace=False)
        data = load_sft_data(
            args.data,
            load_tokenizer(cfg.model),
            evaluation,
            eval_fraction=args.eval_fraction,
            seed=args.seed,
            max_seq_len=cfg.model.max_seq_len,
            enable_thinking=cfg.model.enable_thinking,
        )
    except (DataError, ExcludeError) as err:
        return fail(str(err))
    if not data.train:
        return fail(f"{args.data}: no training example left ({data.examples} read; {data.decontam})")
    for line in data.summary():
        print(line)
    return train(cfg, data, settings, args)


def _check_numbers(args) -> str:
    for flag, value, low in (
        ("--epochs", args.epochs, 1),
        ("--batch-tokens", args.batch_tokens, 16),
        ("--eval-every", args.eval_every, 0),
        ("--export-every", args.export_every, 0),
        ("--checkpoint-every", args.checkpoint_every, 0),
    ):
        if value < low:
            return f"{flag} must be at least {low}, got {value}"
    if not 0 <= args.eval_fraction < 1:
        return f"--eval-fraction must lie in [0, 1), got {args.eval_fraction}"
    if not args.lr >= 0:
        return f"--lr must be >= 0, got {args.lr}"
    return ""


def _run_settings(args) -> dict:
    """What decides the batches of every step: a resumed run must agree on it."""
    return {
        "data": str(Path(args.data).resolve()),
        "epochs": args.epochs,
        "batch_tokens": args.batch_tokens,
        "eval_fraction": args.eval_fraction,
        "seed": args.seed,
    }


def _check_resume(out: Path, args) -> str:
    saved = out / SETTINGS_FILE
    if not saved.is_file():
        return (
            ""
            if not out.exists() or not any(out.iterdir())
            else f"--out {out} exists and is not a kiln sft output directory; choose another"
        )
    before = json.loads(saved.read_text())
    changed = [k for k, v in _run_settings(args).items() if before.get(k) != v]
    if changed:
        return (
            f"--out {out} was trained with other settings ({', '.join(f'{k}={before.get(k)}' for k in changed)});"
            " resume with the same ones or choose another --out"
        )
    return ""


def train(cfg, data, settings, args) -> int:
    from launch.observe.metrics import MetricsLog
    from launch.stages.sft.report import write_report
    from launch.stages.sft.run import SFTRun

    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / SETTINGS_FILE).write_text(json.dumps(_run_settings(args), indent=1))
    tensorboard = cfg.logging.tensorboard and _tensorboard_importable()
    if cfg.logging.tensorboard and not tensorboard:
        print("TensorBoard: the tensorboard package is not importable; logging to metrics.jsonl only")
    run = SFTRun(cfg, data, settings, device=_device(cfg.learner.device))
    with (
        MetricsLog(settings.out, dataclasses.replace(cfg.logging, tensorboard=tensorboard)) as metrics,
        Progress(run.total) as progress,
    ):
        result = run.run(metrics, progress.update)
    if result.resumed_from:
        print(f"resumed from step {result.resumed_from} of {result.steps}")
    loss = (
        f"training loss {result.first_loss:.4f} -> {result.final_loss:.4f}"
        if result.first_loss is not None
        else "no step left to take"
    )
    held = f"; held-out loss {result.held_out[0][1]:.4f} -> {result.held_out[-1][1]:.4f}" if result.held_out else ""
    report = write_report(
        settings.out,
        [
            f"model: {cfg.model.path}",
            f"data: {args.data}",
            *data.summary(),
            (
                f"{result.steps} steps, {settings.epochs} epochs, lr {settings.lr}, "
                f"{settings.batch_tokens} tokens per batch, backend {cfg.learner.backend}"
            ),
        ],
    )
    print(f"{loss}{held} ({result.seconds:.0f} s)")
    print(f"export: {result.final}\nreport: {report}")
    return 0


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _tensorboard_importable() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


class Progress:
    """A progress bar on a terminal (rich), else one line per twentieth of the run, on stderr."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.every = max(1, total // 20)
        self._bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("sft"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("", total=total)

    def __enter__(self) -> Self:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, step: int, total: int, row: dict) -> None:
        text = f"loss {row[mk.SFT_LOSS]:.4f}" + (
            f" held-out {row[mk.SFT_HELDOUT_LOSS]:.4f}" if mk.SFT_HELDOUT_LOSS in row else ""
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=step, description=text)
        elif step % self.every == 0 or step == total:
            print(f"sft step {step}/{total}: {text}", file=sys.stderr, flush=True)
