"""`make demo`'s configuration (configs/default.yaml) through `kiln train`, in-process: the kernel
verifier's path through the driver (real compiles, runs and legality checks on the forced
candidates), with the supervised warm start on the shipped solutions in front of the RL steps.
"""

from __future__ import annotations

import json
from pathlib import Path

from configs import load_config
from launch.metrics import read_metrics
from launch.run_dir import RunDirectory
from launch.train import train

ROOT = Path(__file__).resolve().parent.parent

pytestmark = __import__("pytest").mark.usefixtures("one_torch_thread")


def test_demo_warm_starts_then_trains_on_verified_kernels(tmp_path, verifier_cache_dir, monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's task and solution paths are relative to the repository
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        f"logging.root={tmp_path}", "logging.run_name=demo", "logging.live=false", "logging.tensorboard=false",
        "cluster.use_ray=false", f"verifier.cache_dir={verifier_cache_dir}", "verifier.compile_baseline=never",
        "algo.total_steps=2", "warm_start.steps=3", "warm_start.lr=1e-3", "eval.samples=1"])
    run = RunDirectory.create(cfg)
    train(cfg, run)

    rows = read_metrics(run.path)
    sft = next(r for r in rows if "sft/first_loss" in r)
    assert sft["sft/steps"] == 3 and sft["sft/final_loss"] < sft["sft/first_loss"]
    steps = [r for r in rows if "train/loss" in r]
    assert [int(r["weights/version"]) for r in steps] == [1, 2]
    # Step 1 trains on samples the engine made with version 0. Had the engine served the weights from
    # before the warm start, their behaviour logprobs would be off from the learner's by the SFT's change.
    log_rho = steps[0]["train/abs_log_rho_mean"]
    assert log_rho < 1e-3, log_rho
    outcomes = {k for r in rows for k, v in r.items() if k.startswith("verifier/") and v}
    assert {"verifier/compile", "verifier/run"} <= outcomes, outcomes
    ep = json.loads((run.path / "summary.json").read_text())["episodes"]
    assert ep["invariant_ok"] and ep["trained"] > 0
    assert (run.path / "final" / "config.json").exists()
