"""A whole run's crash and resume, and the no-loss check that says whether anything was lost.

- A resume after a crash that lost the newest checkpoint rolls those versions back: the learner goes on
  from the checkpoint under a new version number, replay filters what the lost versions made as
  `rolled_back`, and the run still makes all its steps.
- The driver itself killed (SIGKILL) mid-run on the demo preset, then `kiln train --resume`: the run
  finishes, nothing waits on the dead session's actors, and the id check holds over both sessions.
- The id check compares independent witnesses (launch/observe/id_check.py) and fails on a planted loss.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.buffer.health import LedgerIds
from actors.buffer.state import ReplayState
from configs import load_config
from launch.driver.run_dir import RunDirectory
from launch.driver.train import train
from launch.observe.id_check import check_ids
from protocols import EpisodeAck
from tests.conftest import DEMO_CI
from tests.launch.driver.test_train import ROOT, text_match


def summary_of(run: RunDirectory) -> dict:
    return json.loads((run.path / "summary.json").read_text())


# ------------------------------------------------------------------------------- the id check


def ledger(trained=(), pending=(), rolled_back=(), **filtered) -> LedgerIds:
    return LedgerIds(
        trained=frozenset(trained),
        filtered={k: frozenset(v) for k, v in filtered.items()},
        pending=frozenset(pending),
        rolled_back=tuple(rolled_back),
    )


def test_the_id_check_names_each_kind_of_loss():
    acked = ["a", "b", "c", "d"]
    holds = check_ids(acked, [(1, "a"), (1, "b"), (2, "c")], ledger(["a", "b", "c"], tied=["d"]))
    assert holds.ok and (holds.trained, holds.filtered, holds.pending) == (3, 1, 0)
    # an acknowledged id replay never stored
    lost = check_ids(acked, [(1, "a"), (1, "b"), (2, "c")], ledger(["a", "b", "c"]))
    assert lost.problems == {"lost": ["d"]}
    # replay counts an id as trained that no learner step trained, and the reverse
    assert check_ids(acked, [(1, "a"), (1, "b")], ledger(["a", "b", "c"], tied=["d"])).problems == {
        "trained_unseen": ["c"]
    }
    assert check_ids(acked, [(1, "a"), (1, "b"), (2, "c")], ledger(["a", "b"], pending=["c"], tied=["d"])).problems == {
        "trained_uncounted": ["c"]
    }
    # trained by two kept steps; a step whose version was rolled back (inside (1, 3)) does not count
    twice = [(1, "a"), (1, "b"), (2, "c"), (4, "c")]
    assert check_ids(acked, twice, ledger(["a", "b", "c"], tied=["d"])).problems == {"trained_twice": ["c"]}
    redone = check_ids(acked, twice, ledger(["a", "b", "c"], rolled_back=[(1, 3)], tied=["d"]))
    assert redone.ok and redone.lost_steps == 1
    # a learner killed after writing step 2's ids and before announcing version 2: the batch is stepped
    # on again and makes version 2 anew, once
    again = check_ids(acked, [(1, "a"), (1, "b"), (2, "c"), (2, "c")], ledger(["a", "b", "c"], tied=["d"]))
    assert again.ok
    # a run stopped while the learner held its last batch: served (counted trained), never stepped on
    held = dataclasses.replace(ledger(["a", "b", "c"], tied=["d"]), in_step=frozenset({"c"}))
    assert check_ids(acked, [(1, "a"), (1, "b")], held).ok


def test_the_id_check_holds_on_a_run_and_fails_when_replay_loses_an_acknowledged_episode(tmp_path, monkeypatch):
    cfg, run = text_match(tmp_path, "holds", "cluster.use_ray=false", "algo.total_steps=3")
    train(cfg, run)
    check = summary_of(run)["id_check"]
    assert check["ok"] and check["acked"] > 0 and check["trained"] > 0, check

    # A planted loss: replay acknowledges one episode as stored and drops it.
    real = ReplayState.on_episode
    dropped: list[str] = []

    def on_episode(self, ep, now):
        if not dropped:
            dropped.append(ep.episode_id)
            return EpisodeAck(episode_id=ep.episode_id, status="stored"), False
        return real(self, ep, now)

    monkeypatch.setattr(ReplayState, "on_episode", on_episode)
    # (its group never completes: it expires after 3 s and its task goes again, so the run goes on)
    cfg, run = text_match(
        tmp_path, "planted", "cluster.use_ray=false", "algo.total_steps=3", "replay.group_timeout_s=3"
    )
    train(cfg, run)
    summary = summary_of(run)
    assert summary["episodes"]["invariant_ok"]  # replay's own ledger cannot see it
    assert not summary["id_check"]["ok"] and summary["id_check"]["problems"] == {"lost": dropped}
    assert f"FAIL: {summary['id_check']['acked']} acknowledged" in (run.path / "report.md").read_text()


# ------------------------------------------------------------------------------- rollback


def test_a_resume_that_lost_versions_rolls_them_back_and_still_makes_every_step(tmp_path):
    cfg, run = text_match(
        tmp_path, "rollback", "cluster.use_ray=false", "algo.total_steps=3", "learner.checkpoint_every=2"
    )
    train(cfg, run)
    checkpoints = sorted((run.path / "checkpoints").glob("step-*"))
    assert [p.name for p in checkpoints] == ["step-000002", "step-000003"]  # every 2 steps, and the final one
    # What a crash after version 3 was announced and before step 3's checkpoint was saved leaves:
    shutil.rmtree(checkpoints[-1])
    (run.path / "checkpoints" / "latest").write_text(checkpoints[0].name)
    more = load_config(run.config_path, ["algo.total_steps=5"])
    train(more, RunDirectory.open(run.path))
    summary = summary_of(run)
    learner = summary["learner"]
    # version 3 was rolled back: the learner went on from version 2 (step 2) as version 4, and made steps 3..5
    assert (learner["restored_from"], learner["rolled_back"], learner["step"]) == (2, 1, 5), learner
    assert learner["version"] == 7, learner  # a version number never names two weights
    assert summary["id_check"]["ok"] and summary["id_check"]["lost_steps"] == 1, summary["id_check"]
    assert [s["session"] for s in summary["sessions"]] == [1, 2] and summary["sessions"][1]["rolled_back"] == 1


# ------------------------------------------------------------------------------- the driver killed


def wait_for(path: Path, text: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            pytest.fail(f"kiln train ended ({proc.returncode}) before printing {text!r}:\n{path.read_text()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"no {text!r} within {timeout_s} s:\n{path.read_text()[-3000:]}")


@pytest.mark.slow
def test_the_driver_killed_mid_run_resumes_and_finishes_with_nothing_lost(
    tmp_path, tiny_chat_model, verifier_cache_dir
):
    """The demo preset (`make demo`: the kernel verifier, forced candidates, BDR) in its CI-sized form
    (test_demo.py's: its candidates compile once per test run, into the session's verifier cache), its
    driver killed with SIGKILL right after step 1, then `kiln train --resume RUN_DIR`, which keeps the
    first session's config."""
    out = tmp_path / "first.log"
    cmd = [sys.executable, "-m", "launch.cli", "train", "--config", "configs/default.yaml"]
    overrides = [
        "cluster.use_ray=false",
        "algo.total_steps=2",
        f"logging.root={tmp_path}",
        "logging.run_name=demo",
        f"verifier.cache_dir={verifier_cache_dir}",
        f"model.path={tiny_chat_model}",
        *DEMO_CI,
    ]
    with out.open("w") as log:
        proc = subprocess.Popen(cmd + overrides, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(out, "step 1/2", 300, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    run = tmp_path / "demo"
    resumed = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", "--resume", str(run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["learner"]["step"] == 2 and summary["learner"]["restored_from"] >= 1, summary["learner"]
    assert summary["id_check"]["ok"], summary["id_check"]
    sessions = summary["sessions"]
    assert len(sessions) == 2 and "ended" not in sessions[0] and "ended" in sessions[1], sessions
    assert "2 (1: crashed" in (run / "report.md").read_text()
