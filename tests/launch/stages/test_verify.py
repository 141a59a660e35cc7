"""`kiln verify` end to end, as a subprocess: one candidate with --json (a pass, a failure that prints
a forged result and exits), raw model output, usage errors, and every shipped cpu solution."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
KILN = [sys.executable, "-m", "launch.cli", "verify"]
RELU = "tasks/level1/01_relu.py"


def kiln(*args: str, cache_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    settings = [f"verifier.cache_dir={cache_dir}", "verifier.compile_baseline=never"]
    return subprocess.run(
        [*KILN, *args, *settings], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_json_pass(verifier_cache_dir):
    p = kiln(
        "--reference",
        RELU,
        "--candidate",
        "tasks/solutions/cpu/level1/01_relu.py",
        "--backend",
        "cpu",
        "--json",
        cache_dir=verifier_cache_dir,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["passed"] is True and out["stage"] == "done" and out["error_class"] is None
    assert out["q"] == 1.0 and out["score"] >= 1.0 and out["speedup_eager"] > 0 and "Speedup" in out["feedback"]


def test_json_failure_with_forged_output_and_exit(verifier_cache_dir):
    """The candidate prints a passing JSON verdict and calls os._exit(0): stdout still holds exactly one
    JSON object, the verifier's, and it says cheating."""
    p = kiln(
        "--reference",
        RELU,
        "--candidate",
        "tests/adversarial/common/exit_forged_result.py",
        "--json",
        cache_dir=verifier_cache_dir,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)  # raises if anything else reached stdout
    assert out["passed"] is False and out["error_class"] == "cheating" and out["score"] == -1.0
    assert out["speedup_eager"] is None and "status 0" in out["feedback"]


def test_raw_model_output_and_text_mode(verifier_cache_dir, tmp_path):
    answer = tmp_path / "answer.md"
    answer.write_text(
        "Sure! Here is the kernel.\n\n```python\nimport torch\nimport torch.nn as nn\n\n"
        "class ModelNew(nn.Module):\n    def forward(self, x):\n        return x.relu()\n```\n"
    )
    p = kiln("--reference", RELU, "--candidate", str(answer), cache_dir=verifier_cache_dir)
    assert p.returncode == 0, p.stderr
    assert "FAIL (cheating)" in p.stdout and "aten::relu" in p.stdout


def test_a_usage_error_exits_2_with_one_line_and_nothing_on_stdout(tmp_path):
    p = kiln("--reference", "nope.py", "--candidate", RELU, cache_dir=tmp_path, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "kiln verify: file not found: nope.py\n", p.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--reference", "nope.py", "--candidate", RELU], "file not found: nope.py"),
        (["--reference", RELU, "--candidate", RELU, "--backend", "rocm"], "unknown backend 'rocm'"),
        (["--reference", RELU], "--reference and --candidate go together"),
        (["--tasks", "tasks", "--solutions", "no/such/dir"], "solutions directory not found"),
        (["--reference", "tasks/loader.py", "--candidate", RELU], "no KernelBench-format reference"),
    ],
)
def test_usage_errors_exit_nonzero_with_one_line(args, message, tmp_path, capfd, monkeypatch):
    """In-process (the command's process around it is the test above): what reaches descriptors 1 and 2."""
    from launch.cli.main import main

    monkeypatch.chdir(REPO)
    code = main(["verify", *args, f"verifier.cache_dir={tmp_path}", "verifier.compile_baseline=never"])
    out, err = capfd.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_every_shipped_cpu_solution_passes(verifier_cache_dir):
    """Zero false rejections: the whole shipped set through `kiln verify --tasks --solutions`."""
    p = kiln(
        "--tasks",
        "tasks",
        "--solutions",
        "tasks/solutions/cpu",
        "--backend",
        "cpu",
        "--json",
        "verifier.compile_workers=2",
        "verifier.run_workers=1",
        cache_dir=verifier_cache_dir,
        timeout=1500,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout)["results"]
    assert len(results) == 24
    failed = {r["task_id"]: r.get("feedback") for r in results if not r.get("passed")}
    assert failed == {}, json.dumps(failed, indent=1)
    # The physical plausibility bound never takes a shipped solution's speedup away.
    clamped = {r["task_id"]: r["diagnostics"]["speed_clamped"] for r in results if "speed_clamped" in r["diagnostics"]}
    assert clamped == {}, clamped
    table = kiln("--tasks", "tasks", "--solutions", "tasks/solutions/cpu", cache_dir=verifier_cache_dir)
    assert table.returncode == 0 and "24/24 passed" in table.stdout, table.stdout  # verdicts now cached


def test_cuda_without_a_preset_verifies_with_the_production_protocol_not_the_cpu_demos():
    """configs/default.yaml sizes its verifier for the CPU demo (a 5 s run limit): a CUDA task's
    correctness and timing alone take longer. `--backend cuda` without `--config` takes the schema's
    protocol, as the GPU presets do; an explicit preset and `verifier.*` overrides stay as given."""
    import argparse

    from configs import VerifierConfig
    from launch.config_args import load_for_backend
    from launch.stages.verify import _plan

    production = VerifierConfig()
    args = argparse.Namespace(
        reference="tasks/level1/01_relu.py",
        candidate="tasks/solutions/cuda/level1/01_relu.py",
        tasks=None,
        solutions=None,
        backend="cuda",
        config=None,
        overrides=[],
    )
    cfg, jobs = _plan(args)
    assert cfg.backend == "cuda" and jobs[0][0].task_id == "level1/01_relu"
    assert (cfg.run_timeout_s, cfg.trials, cfg.warmup, cfg.repeats) == (
        production.run_timeout_s,
        production.trials,
        production.warmup,
        production.repeats,
    )
    demo = load_for_backend(None, [], None).verifier
    assert demo.backend == "cpu" and demo.run_timeout_s == 5.0  # the demo itself is unchanged
    assert load_for_backend("configs/default.yaml", [], "cuda").verifier.run_timeout_s == 5.0
    assert load_for_backend(None, ["verifier.trials=2"], "cuda").verifier.trials == 2
