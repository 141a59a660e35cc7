"""`kiln train` with `verifier.remote`: the demo preset (configs/default.yaml, CI-sized) end to end with
its attempts verified by a verifier service (`kiln serve`, the kernel verifier on cpu behind it) and no
verifier actor of its own. The service runs in this process, on loopback, as a user would start it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from configs import load_config
from launch.driver.checks import check_remote_verifier
from launch.driver.run_dir import RunDirectory
from launch.driver.train import train
from launch.serve.cli import start
from tests.conftest import demo_run_overrides

ROOT = Path(__file__).resolve().parents[3]
VERIFIER = ["verifier.compile_baseline=never"]  # the demo's verifier section, as DEMO_CI sizes it


@pytest.fixture(scope="module")
def service(verifier_cache_dir):
    cfg = load_config(
        ROOT / "configs" / "default.yaml",
        [*VERIFIER, f"verifier.cache_dir={verifier_cache_dir}", "serve.port=0", f"serve.tasks={ROOT / 'tasks'}"],
    )
    running = start(cfg)
    yield running
    running.stop()


def test_the_demo_trains_with_a_remote_verifier(tmp_path, tiny_chat_model, service, one_torch_thread, monkeypatch):
    monkeypatch.chdir(ROOT)  # the preset's task and solution paths are relative to the repository
    cfg = load_config(
        ROOT / "configs" / "default.yaml",
        [
            *demo_run_overrides(tmp_path, "remote", tiny_chat_model),
            "model.max_seq_len=8192",
            "replay.tasks=tasks/level2",
            "algo.total_steps=2",
            "eval.samples=1",
            f"verifier.remote={service.url}",
            *VERIFIER,
        ],
    )
    assert check_remote_verifier(cfg.verifier) == []
    before = service.service.dispatcher.snapshot()["verdicts"]
    run = RunDirectory.create(cfg)
    train(cfg, run)
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["learner"]["version"] >= 2
    ep = summary["episodes"]
    assert ep["invariant_ok"] and ep["trained"] >= 2 * cfg.algo.batch_groups * cfg.algo.group_size
    # Every verdict came from the service: it answered at least the trained attempts, and its answers
    # include passes of the forced solutions and failures of the forced wrong ones.
    after = service.service.dispatcher.snapshot()["verdicts"]
    answered = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert sum(answered.values()) >= ep["trained"], answered
    assert answered.get("pass", 0) > 0 and answered.get("compile", 0) + answered.get("correctness", 0) > 0, answered
    assert answered.get("infra", 0) == 0, answered


def test_a_remote_verifier_of_another_backend_or_unreachable_is_a_start_up_error(service):
    cfg = load_config(None, [f"verifier.remote={service.url}", "verifier.backend=cuda"])
    (finding,) = check_remote_verifier(cfg.verifier)
    assert finding.level == "error" and "verifies on 'cpu', the run's verifier.backend is 'cuda'" in finding.text
    cfg = load_config(None, ["verifier.remote=http://127.0.0.1:9", "verifier.backend=cpu"])
    (finding,) = check_remote_verifier(cfg.verifier)
    assert finding.level == "error" and "cannot reach http://127.0.0.1:9" in finding.text
