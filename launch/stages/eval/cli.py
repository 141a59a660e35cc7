"""`kiln eval`: the KernelBench protocol (Pass@k, Avg@n, Faster-vs-eager / -compile above a speedup
threshold, per level and Overall) for a checkpoint, a served model or an answer set.

    kiln eval --model DIR|RUN_DIR --tasks DIR [DIR ...] [--samples 8] [--k 1,8] [--backend cuda|cpu]
    kiln eval --model DIR --engine-urls URL [URL ...] --tasks DIR ...     (a model already served by SGLang)
    kiln eval --answers FILE.jsonl --tasks DIR ...                        (answers produced elsewhere)
    kiln eval --compare A/summary.json B/summary.json

Outputs go to --out (default <logging.root>/eval/<name>/): table.md, summary.json, attempts.jsonl,
chart.png. Running the same command again resumes from attempts.jsonl. docs/eval.md has the details.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from launch.config_args import load_for_backend
from launch.driver.checks import StartupError, check_model, errors
from launch.observe.words import plural

_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*\.[\w]+=")


class UsageError(ValueError):
    """Bad command-line input: one line, exit status 2."""


def add_eval_parser(sub) -> None:
    from launch.config_args import add_config_arguments

    p = sub.add_parser("eval", help="Pass@k, Avg@n and Faster-than-eager/compile of a model or an answer set")
    src = p.add_argument_group("what to evaluate")
    src.add_argument(
        "--model", metavar="DIR", help="an HF checkpoint directory, a run directory (its final/), or kiln:tiny-chat"
    )
    src.add_argument("--engine-urls", nargs="+", metavar="URL", help="SGLang-API servers serving --model")
    src.add_argument(
        "--answers",
        metavar="FILE.jsonl",
        help='answers produced elsewhere: {"task_id": ..., "sample": ..., "text": ...} per line',
    )
    src.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two summaries side by side")
    p.add_argument(
        "--tasks",
        nargs="+",
        metavar="DIR",
        help="task directories: Kiln's tasks/, KernelBench-format files, or a KernelBench clone's root",
    )
    p.add_argument("--samples", type=int, default=8, help="n: attempts sampled per task (default 8)")
    p.add_argument("--k", default=None, help="comma-separated k of Pass@k (default: 1 and n)")
    p.add_argument("--backend", choices=("cpu", "cuda"), help="verifier backend (default: verifier.backend)")
    p.add_argument(
        "--fast-threshold",
        type=float,
        help="speedup an attempt must exceed to count as faster (default eval.fast_threshold, 1.1)",
    )
    p.add_argument("--temperature", type=float, help="sampling temperature (default eval.temperature, 0.7)")
    p.add_argument("--top-p", type=float, help="nucleus sampling (default eval.top_p, 0.95)")
    p.add_argument("--max-new-tokens", type=int, help="answer length limit (default eval.max_new_tokens)")
    p.add_argument(
        "--thinking", choices=("on", "off"), help="let a thinking model think (default model.enable_thinking)"
    )
    p.add_argument("--out", metavar="DIR", help="output directory (default <logging.root>/eval/<name>)")
    p.add_argument("--name", help="the table row's label (default: the model's or answer file's name)")
    p.add_argument("--ray", action="store_true", help="engines and verifiers as Ray actors (default: in-process)")
    add_config_arguments(p)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from launch.stages.eval.answers import AnswersError
    from launch.stages.eval.run import EvalError, run_evaluation
    from tasks.loader import TaskLoadError

    try:
        if args.compare:
            return _compare(*args.compare)
        plan = _plan(args)
    except (UsageError, AnswersError, TaskLoadError, EvalError) as err:
        print(f"kiln eval: {err}", file=sys.stderr)
        return 2
    for failed in plan.task_set.failed:
        print(f"kiln eval: warning: task file {failed.path} not loaded: {failed.reason}", file=sys.stderr)
    for line in plan.rejected_answers:
        print(f"kiln eval: warning: answer left out: {line}", file=sys.stderr)
    if plan.use_ray:
        _start_ray(plan.cfg)
    try:
        doc = run_evaluation(plan)
    except EvalError as err:
        print(f"kiln eval: {err}", file=sys.stderr)
        return 2
    print((plan.out / "table.md").read_text(), end="")
    print(
        f"\nwrote {plan.out}/table.md, summary.json, attempts.jsonl, chart.png "
        f"({plural(doc['counts']['verified'], 'attempt')} verified now, {doc['counts']['resumed']} resumed)"
    )
    return 0


def _plan(args: argparse.Namespace):
    from launch.stages.eval.answers import read_answers
    from launch.stages.eval.run import EvalPlan
    from launch.stages.eval.sources import load_task_set

    modes = [m for m in ("model", "answers") if getattr(args, m)]
    if len(modes) != 1:
        raise UsageError("give --model DIR (with --engine-urls for a served model) or --answers FILE.jsonl")
    if args.engine_urls and not args.model:
        raise UsageError(
            "--engine-urls needs --model DIR: the checkpoint the servers serve (its tokenizer and "
            "chat template pose the prompts)"
        )
    if not args.tasks:
        raise UsageError("--tasks DIR [DIR ...] is required")
    # `--tasks DIR section.key=value`: argparse gives the trailing overrides to --tasks
    overrides = [t for t in args.tasks if _OVERRIDE.match(t) and not Path(t).exists()]
    args.tasks = [t for t in args.tasks if t not in overrides]
    args.overrides = overrides + list(args.overrides or [])
    if not args.tasks:
        raise UsageError("--tasks DIR [DIR ...] is required")
    if args.samples < 1:
        raise UsageError(f"--samples must be >= 1, got {args.samples}")
    cfg = _apply_flags(load_for_backend(args.config, args.overrides, args.backend), args)
    task_set = load_task_set(args.tasks, cfg.verifier.backend)
    mode = modes[0]
    answers, rejected, samples, sampling = None, [], args.samples, None
    if mode == "answers":
        answer_set = read_answers(args.answers, {t.task_id for t in task_set.tasks})
        answers, rejected = answer_set.answers, answer_set.rejected
        if not answers:
            raise UsageError(
                f"{args.answers} holds no usable answer for the loaded tasks "
                f"({plural(len(rejected), 'line')} left out{': ' + rejected[0] if rejected else ''})"
            )
        per_task: dict[str, int] = {}
        for a in answers:
            per_task[a.task_id] = per_task.get(a.task_id, 0) + 1
        samples = max(per_task.values())
        source, name = str(Path(args.answers).resolve()), Path(args.answers).stem
    else:
        cfg, source, name = _model(cfg, args)
        sampling = {
            "temperature": cfg.eval.temperature,
            "top_p": cfg.eval.top_p,
            "max_new_tokens": cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
            "enable_thinking": cfg.model.enable_thinking,
            "engine": cfg.rollout.engine,
        }
    ks = _ks(args.k, samples, mode)
    name = args.name or name
    out = Path(args.out) if args.out else Path(cfg.logging.root) / "eval" / name
    return EvalPlan(
        name=name,
        mode=mode,
        source=source,
        task_set=task_set,
        ks=ks,
        samples=samples,
        out=out,
        cfg=cfg,
        use_ray=args.ray,
        answers=answers,
        rejected_answers=rejected,
        sampling=sampling,
    )


def _apply_flags(cfg, args):
    verifier = cfg.verifier
    if args.backend:
        verifier = dataclasses.replace(verifier, backend=args.backend)
    ev = cfg.eval
    for flag, key, ok in (
        ("fast_threshold", "fast_threshold", lambda v: v > 0),
        ("temperature", "temperature", lambda v: v > 0),
        ("top_p", "top_p", lambda v: 0 < v <= 1),
        ("max_new_tokens", "max_new_tokens", lambda v: v >= 1),
    ):
        value = getattr(args, flag)
        if value is not None:
            if not ok(value):
                raise UsageError(f"--{flag.replace('_', '-')}={value} is out of range")
            ev = dataclasses.replace(ev, **{key: value})
    model = cfg.model
    if args.thinking:
        model = dataclasses.replace(model, enable_thinking=args.thinking == "on")
    # Evaluation answers are sampled, never forced; one turn, with the evaluation's length limit.
    rollout = dataclasses.replace(
        cfg.rollout, forced_candidates=None, max_new_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens
    )
    return dataclasses.replace(cfg, verifier=verifier, eval=ev, model=model, rollout=rollout)


def _ks(text: str | None, samples: int, mode: str) -> tuple[int, ...]:
    if text is None:
        return tuple(sorted({1, samples}))
    try:
        ks = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise UsageError(f"--k takes comma-separated integers, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise UsageError(f"--k values must be >= 1, got {text!r}")
    if ks[-1] > samples:
        what = "--samples" if mode == "model" else "the most answers any task has"
        raise UsageError(f"--k {ks[-1]} exceeds {what} ({samples}): Pass@k needs k attempts per task")
    return ks


def _model(cfg, args):
    """The config with model.path (and the engine) set for --model / --engine-urls; its source and name."""
    from launch.driver.tiny_checkpoint import BUILTIN_PATH, resolve_model_path

    given = args.model
    path = given
    if given != BUILTIN_PATH:
        p = Path(given).expanduser()
        for candidate in (p, p / "final"):
            if (candidate / "config.json").is_file():
                path = str(candidate)
                break
        else:
            raise UsageError(
                f"--model {given}: not a checkpoint directory (no config.json) nor a run directory with final/"
            )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))
    cfg = resolve_model_path(cfg)
    findings = errors(check_model(cfg.model))
    if findings:
        raise StartupError(findings)
    if args.engine_urls:
        sglang = dataclasses.replace(cfg.rollout.sglang, urls=list(args.engine_urls))
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="sglang", sglang=sglang))
        source = f"{cfg.model.path} served at {' '.join(args.engine_urls)}"
    else:
        source = cfg.model.path
    name = Path(given).name if given != BUILTIN_PATH else "tiny-chat"
    if name == "final":
        name = Path(given).parent.name
    return cfg, source, name


def _compare(a_path: str, b_path: str) -> int:
    from launch.stages.eval.table import markdown_table, setting_differences

    docs = []
    for path in (a_path, b_path):
        try:
            docs.append(json.loads(Path(path).read_text()))
        except OSError as err:
            raise UsageError(f"cannot read {path}: {err.strerror}") from None
        except ValueError:
            raise UsageError(f"{path} is not a JSON summary written by kiln eval") from None
        if not isinstance(docs[-1], dict) or "rows" not in docs[-1]:
            raise UsageError(f"{path} is not a JSON summary written by kiln eval")
    a, b = docs
    for line in setting_differences(a, b):
        print(f"kiln eval: warning: the two evaluations differ in {line}", file=sys.stderr)
    print(markdown_table([(a.get("name", a_path), a), (b.get("name", b_path), b)], deltas=True))
    return 0


def _start_ray(cfg) -> None:
    from launch.driver.cluster import start_ray

    start_ray(cfg.cluster)
