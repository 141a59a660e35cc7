"""`kiln export`: turn a training checkpoint into a servable HF directory.

    kiln export RUN_DIR [--step N] [--out DIR] [section.key=value ...]

The checkpoint `RUN_DIR/checkpoints/step-NNNNNN` (the latest without --step) is loaded into the run's
learner backend on this machine and written as `learner.export_every` and `RUN_DIR/final/` are: the
weights and config, the tokenizer files with the chat template, and a generation_config.json with the
rollout's sampling settings (actors/policy/export.py). The default destination is
`RUN_DIR/exports/step-NNNNNN/`. Checkpoints of the torch backend export anywhere (on CPU); a
megatron run's checkpoints are sharded over its GPUs, so such a run exports while it trains
(`learner.export_every`). Every problem is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from configs import load_config


def add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="turn a training checkpoint into a servable HF directory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.yaml and checkpoints/)")
    p.add_argument("--step", type=int, help="the checkpoint's learner step (default: the latest)")
    p.add_argument("--out", metavar="DIR", help="where to write it (default: RUN_DIR/exports/step-NNNNNN)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from actors.learner.checkpoint import CHECKPOINTS, META, read_latest, step_dir_name
    from launch.driver.run_dir import RunDirectory
    from launch.driver.tiny_checkpoint import resolve_model_path

    run = RunDirectory.open(Path(args.run_dir))
    cfg = resolve_model_path(load_config(run.config_path, args.overrides))
    if cfg.learner.backend != "torch":
        return _fail(
            f"{run.path} trained with learner.backend={cfg.learner.backend}, whose checkpoints are "
            "sharded over its GPUs; export during the run with learner.export_every"
        )
    root = run.path / CHECKPOINTS
    if args.step is None:
        latest = read_latest(run.path)
        if latest is None:
            return _fail(f"{run.path} has no checkpoint yet")
        state, step = latest[0], latest[1].step
    else:
        step, state = args.step, root / step_dir_name(args.step) / "state"
        if not (state.parent / META).is_file():
            have = sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / META).is_file())
            return _fail(
                f"{run.path} has no checkpoint at step {args.step} (steps with one: "
                f"{', '.join(map(str, have)) or 'none'})"
            )
    out = Path(args.out) if args.out else run.path / "exports" / step_dir_name(step)
    if out.exists():
        return _fail(f"{out} exists; remove it or choose another --out")
    version = json.loads((state.parent / META).read_text())["version"]
    export_checkpoint(cfg, state, out)
    print(f"kiln: exported step {step} (weight version {version}) to {out}")
    return 0


def export_checkpoint(cfg, state: Path, out: Path) -> Path:
    """Load a torch-backend checkpoint's state directory on CPU and export it to `out`."""
    from actors.learner.torch_backend import TorchBackend
    from actors.policy.export import GenerationSettings, export_servable

    backend = TorchBackend(cfg.model, cfg.learner, device="cpu")
    backend.load_checkpoint(state)
    return export_servable(out, backend.export_hf, cfg.model, GenerationSettings.from_rollout(cfg.rollout))


def _fail(message: str) -> int:
    print(f"kiln export: {message}", file=sys.stderr)
    return 2
