"""The config arguments every subcommand that reads a config shares: `--config FILE` and trailing
`section.key=value` overrides, and how a command with `--backend` loads its config. Subcommands import
these from here, never from the `kiln` entry point (launch/cli/main.py), so the import graph of launch/
runs one way: the CLI imports the subcommands, no subcommand imports the CLI.
"""

from __future__ import annotations

import argparse

from configs import load_config


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML preset (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")


def load_for_backend(config: str | None, overrides, backend: str | None):
    """The config of a command that takes `--backend` (verify, eval). configs/default.yaml is the CPU
    demo: its verifier section (a 5 s run limit, 3 trials, 5 timed runs) is sized for small CPU
    candidates, and a CUDA task's correctness and timing alone take longer than its run limit. So
    `--backend cuda` without `--config` verifies with the schema's protocol, as the GPU presets do;
    an explicit preset and `verifier.*` overrides are kept as given."""
    on_gpu_from_demo = backend == "cuda" and config is None
    cfg = load_config(config, overrides, preset_without=("verifier",) if on_gpu_from_demo else ())
    if backend:
        cfg.verifier.backend = backend
    return cfg
