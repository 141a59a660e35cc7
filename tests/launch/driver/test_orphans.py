"""No orphans (docs/training.md, "Faults"): whatever ends the driver, every process Kiln started is gone
within 10 s; SIGTERM stops `kiln train` as Ctrl-C does, with one line and no stack dump.

Descendants are found by recording the driver's process tree while it runs (pid and start time),
not by walking it after the kill: by then the survivors have been reparented to init. The sandboxes
are the real ones (a root test machine gives them a uid of their own, which clears a parent-death
signal), forked by the zygote while they run a candidate.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.verifier import proctree
from launch.driver.lifeline import start_time
from tests.helpers.common import runs_as_sandbox

ROOT = Path(__file__).resolve().parents[3]
PROBE = ROOT / "tests" / "verifier" / "orphan_probe.py"
GRACE_S = 10.0
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are given by a root verifier")


class Tree:
    """Every process seen below `top` (pid -> start time), for asking later which are still running."""

    def __init__(self, top: int) -> None:
        self.top, self.seen = top, {}

    def look(self) -> list[int]:
        pids = proctree.descendants(self.top)[1:]
        for pid in pids:
            if (t := start_time(pid)) is not None:
                self.seen.setdefault(pid, t)
        return pids

    def wait_for(self, what: str, ready, timeout_s: float, proc: subprocess.Popen, out: Path | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready(self.look()):
                return
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        tail = out.read_text()[-3000:] if out else ""
        pytest.fail(f"no {what} within {timeout_s:g} s (exit {proc.poll()}): {tail}")

    def running(self) -> list[int]:
        return [p for p, t in self.seen.items() if start_time(p) == t and proctree._alive(p)]

    def gone_within(self, seconds: float) -> list[int]:
        """The recorded processes still running after `seconds` (polled, so a quick end returns early)."""
        deadline = time.monotonic() + seconds
        while (left := self.running()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [f"{p} {_cmdline(p)}" for p in left]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def _kill_all(tree: Tree, proc: subprocess.Popen) -> None:
    """Clean up after a failed assertion, so one failure does not leave a run spinning."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in tree.running():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _train(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "train", "--config", "configs/default.yaml"]
        + [f"logging.root={tmp_path / 'runs'}", "algo.total_steps=50", *overrides],
        cwd=ROOT,
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    return proc, out


@root_only
def test_a_killed_zygote_takes_its_wardens_and_their_sandboxes(verifier_cache_dir):
    """SIGKILL to the zygote itself (not its verifier) while a sandbox, under a uid of its own, spins in
    forward: the warden dies with the zygote (its parent-death signal, armed first thing after the
    fork) and the sandbox with the warden (re-armed after its uid change)."""
    verifier = subprocess.Popen(
        [sys.executable, str(PROBE), str(verifier_cache_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    tree = Tree(verifier.pid)
    try:
        line = verifier.stdout.readline()
        assert line.startswith("zygote "), line
        zygote = int(line.split()[1])
        tree.wait_for("spinning sandbox", lambda pids: any(runs_as_sandbox(p) for p in pids), 120, verifier)
        below = Tree(zygote)
        below.look()
        os.kill(zygote, signal.SIGKILL)
        assert not below.gone_within(GRACE_S), "outlived their zygote"
    finally:
        _kill_all(tree, verifier)


@root_only
def test_a_killed_driver_leaves_no_process_behind(tmp_path):
    """`kiln train` (actors in-process) SIGKILLed, the driver alone, once its verifier's zygote has forked
    a sandbox: the zygote, wardens, sandboxes, the lifeline keeper, everything it started, gone within
    10 s."""
    proc, out = _train(tmp_path, "cluster.use_ray=false")
    tree = Tree(proc.pid)
    try:
        tree.wait_for("sandbox", lambda pids: any(runs_as_sandbox(p) for p in pids), 180, proc, out)
        tree.look()
        assert any("actors.verifier.zygote" in _cmdline(p) for p in tree.running())
        proc.kill()  # SIGKILL to the driver's pid only, not its process group
        proc.wait()
        assert not tree.gone_within(GRACE_S), "outlived the driver"
    finally:
        _kill_all(tree, proc)


def _interrupted_cleanly(proc: subprocess.Popen, out: Path, tree: Tree) -> None:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    text = out.read_text()
    assert code == 130, text[-3000:]
    assert "Traceback" not in text and "SIGTERM received" not in text, text[-3000:]
    assert text.count("kiln: interrupted") == 1, text[-3000:]
    assert text.rstrip().endswith("kiln: interrupted"), text[-3000:]
    assert not tree.gone_within(GRACE_S), "outlived a clean stop"


def test_sigterm_stops_training_like_ctrl_c(tmp_path):
    """SIGTERM mid-run (actors in-process) takes Ctrl-C's path: the learner checkpoints, everything
    stops, one line, exit status 130."""
    proc, out = _train(tmp_path, "cluster.use_ray=false")
    tree = Tree(proc.pid)
    try:
        tree.wait_for("training loop", lambda _: "started rollout-0" in out.read_text(), 180, proc, out)
        _interrupted_cleanly(proc, out, tree)
        assert "interrupted: checkpointing the learner" in out.read_text()
    finally:
        _kill_all(tree, proc)


def test_sigterm_once_ray_started_is_not_ray_s_stack_dump(tmp_path):
    """ray.init puts its own SIGTERM handlers in the driver (sys.exit(15), then a C++ stack dump and an
    abort); once Ray's first worker runs, a SIGTERM stops the run as Ctrl-C does."""
    pytest.importorskip("ray")
    proc, out = _train(tmp_path, "cluster.use_ray=true")
    tree = Tree(proc.pid)
    try:
        tree.wait_for("Ray's actors", lambda pids: any("ray::" in _cmdline(p) for p in pids), 180, proc, out)
        _interrupted_cleanly(proc, out, tree)
    finally:
        _kill_all(tree, proc)
