"""The supervisor's prompt notice of a dead actor and its second try at a replacement that fails to
start, with a small actor of the `Actor` lifecycle run in-process."""

from __future__ import annotations

import pytest

from actors.base import Actor, ActorHealth, RunContext, Slot
from launch.driver.handles import ActorHandle
from launch.driver.supervisor import MAX_START_ATTEMPTS, ActorSpec, Supervisor


class Ticker(Actor):
    role = "ticker"
    failing_starts = 0  # the next this many start() calls fail

    def __init__(self, ctx: RunContext) -> None:
        super().__init__()

    def start(self) -> dict[str, str]:
        if Ticker.failing_starts:
            Ticker.failing_starts -= 1
            raise RuntimeError("a peer is not ready")
        self.spawn(lambda: self._stop.wait(), "tick")
        return {}

    def health(self) -> ActorHealth:
        return ActorHealth(role=self.role, alive=not self.stopping, looping=self.threads_running)


def test_an_actor_that_ends_is_noticed_at_once_and_restarted_at_the_check(tmp_path):
    supervisor = Supervisor(tmp_path, use_ray=False)
    ticker = supervisor.launch(ActorSpec(name="ticker", cls=Ticker, handle=ActorHandle))
    try:
        assert not supervisor.end_seen()
        ticker.kill()  # in-process: a stop, which the driver did not ask for
        assert supervisor.end_seen() and supervisor.end_seen()  # said until a check looks
        died: list[str] = []
        assert supervisor.check(on_death=died.append) == ["ticker"] and died == ["ticker"]
        assert not supervisor.end_seen()  # the replacement is watched afresh
        assert supervisor["ticker"] is not ticker and supervisor["ticker"].health().healthy
    finally:
        supervisor.stop_all(["ticker"])


def test_a_replacement_that_fails_to_start_is_started_again_at_the_next_check_up_to_a_limit(tmp_path):
    supervisor = Supervisor(tmp_path, use_ray=False)
    first = supervisor.launch(ActorSpec(name="ticker", cls=Ticker, handle=ActorHandle))
    try:
        first.kill()
        Ticker.failing_starts = 1  # a peer it needs is restarting too, say
        assert supervisor.check() == []  # the replacement failed: logged, not raised
        assert supervisor["ticker"] is first  # still the dead one, so the next check restarts it
        assert supervisor.check() == ["ticker"] and supervisor["ticker"].health().healthy
        supervisor["ticker"].kill()
        Ticker.failing_starts = MAX_START_ATTEMPTS
        for _ in range(MAX_START_ATTEMPTS - 1):
            assert supervisor.check() == []
        with pytest.raises(RuntimeError, match="not ready"):  # failed every time: the run ends with its error
            supervisor.check()
    finally:
        Ticker.failing_starts = 0
        supervisor.stop_all(["ticker"])


LOGGING_PROCESS = """
import logging, sys
from actors.base import RunContext, log_to_run_dir
ctx = RunContext(run_dir=sys.argv[1], name="learner", log_level="INFO")
path = log_to_run_dir(ctx)
log_to_run_dir(ctx)  # once per process and file: no line is written twice
logging.getLogger("kiln.test").info("restored step %s", sys.argv[2])
logging.getLogger("kiln.test").debug("below the level")
logging.getLogger("kiln.test").warning("a warning")
print(path)
"""


def test_an_actor_in_its_own_process_logs_into_the_run_directory_and_its_replacement_appends(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    for step in ("7", "8"):  # the actor, then its replacement
        done = subprocess.run(
            [sys.executable, "-c", LOGGING_PROCESS, str(tmp_path), step],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(tmp_path / "logs" / "learner.log")
        assert "a warning" in done.stderr and "restored" not in done.stderr  # warnings reach the console too
    lines = (tmp_path / "logs" / "learner.log").read_text().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "restored step 7",
        "a warning",
        "restored step 8",
        "a warning",
    ]
    # the time to the millisecond, the level, the logger, the process and the thread
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} INFO kiln\.test \[\d+ MainThread\] restored", lines[0])
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the run directory should be")
    done = subprocess.run(
        [sys.executable, "-c", LOGGING_PROCESS, str(blocked), "9"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "cannot write the log file" in done.stderr  # the actor runs on


def test_an_actor_without_a_gpu_prefers_its_labelled_node_and_falls_back_to_any(tmp_path):
    supervisor = Supervisor(tmp_path, use_ray=True)
    assert supervisor.ray_options(Slot()) == {}  # Ray picks
    assert supervisor.ray_options(Slot(), "kiln-node=cpu") == {
        "label_selector": {"kiln-node": "cpu"},
        "fallback_strategy": [{"label_selector": {}}],  # any node, once none with the label is alive
    }
