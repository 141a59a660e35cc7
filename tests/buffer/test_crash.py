"""Kill -9 the replay process mid-run, twice, and lose nothing.

The replay runs as its own process (`python -m actors.buffer`). In this process a producer thread
plays the rollouts (task requests, real Episode records sent through `EpisodeSender`) and a learner
thread asks for batches, both over real ZMQ sockets. The first kill lands while the producer holds
unacknowledged episodes of a group; the second at an arbitrary moment. Each time a new replay
process recovers the run directory and announces a new address, which the clients re-read.
Afterwards the run directory is opened in-process and the episode-id invariant is checked:
every episode the producer made is stored exactly once, the learner trained on exactly the
episodes replay counts as trained, and emitted = trained + filtered + pending.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from actors.base import RunContext
from actors.buffer import ReplayActor
from configs import load_config
from protocols import BatchRequest, TaskRequest
from protocols.channels import ChannelTimeout, RequestClient
from protocols.episodes import EpisodeSender
from protocols.registry import Registry
from tests.helpers.common import wait_for
from tests.helpers.synthetic import TurnSpec, make_episode

REPO = Path(__file__).resolve().parents[2]
STEPS, G, B = 10, 4, 2
OVERRIDES = [
    "replay.task_source=actors.buffer.examples.TextMatchTasks",
    "replay.val_fraction=0",
    "algo.max_staleness=1",
    "replay.group_timeout_s=3",
    "replay.snapshot_every=25",
    "replay.retry_after_s=0.05",
    "replay.retry.probability=0.3",
    f"algo.group_size={G}",
    f"algo.batch_groups={B}",
    f"algo.total_steps={STEPS}",
    "logging.level=WARNING",
]


class ReplayProcess:
    def __init__(self, run_dir: Path, log: Path) -> None:
        self.run_dir, self.log = run_dir, log
        self.proc: subprocess.Popen | None = None
        self.starts: list[dict] = []

    def start(self) -> dict:
        with open(self.log, "a") as stderr:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "actors.buffer", "--run-dir", str(self.run_dir), *OVERRIDES],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        assert ready, "replay process did not start within 60 s"
        info = json.loads(self.proc.stdout.readline())
        self.starts.append(info)
        return info

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


class Producer(threading.Thread):
    """Plays the rollouts: asks for tasks, makes G episodes per group, keeps them until acked."""

    def __init__(self, run_dir: Path, learner: Learner, crash) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.learner, self.crash = run_dir, learner, crash
        self.sender = EpisodeSender(Registry(run_dir).resolver("replay", "replay"), timeout_s=1.0)
        self.made: dict[str, object] = {}
        self.crash_now = threading.Event()
        self.stop = threading.Event()
        self.rng = np.random.default_rng(7)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # noqa: BLE001 - any error, a failed assert included, is surfaced by the test
            self.error = err

    def _run(self) -> None:
        client, address = None, ""
        while not self.stop.is_set():
            self.sender.pump()
            if self.sender.unacked:
                time.sleep(0.05)
                continue
            if client is None or Registry(self.run_dir).address("replay", "replay") != address:
                client and client.close()
                address = Registry(self.run_dir).address("replay", "replay")
                client = RequestClient(address, timeout_s=1.0, retries=0)
            try:
                reply = client.request(TaskRequest(actor_id="producer"))
            except ChannelTimeout:
                client.close()
                client = None
                continue
            if reply.status == "stop":
                break
            if reply.status == "wait":
                time.sleep(reply.retry_after_s)
                continue
            for i in range(reply.group_size):
                ep = make_episode(reply.task, reply.group_id, i, self._turns(), rng=self.rng)
                self.made[ep.episode_id] = ep
                self.sender.submit(ep)
            if self.crash_now.is_set():  # first kill: with a whole group unacknowledged
                self.crash_now.clear()
                self.sender.client.request(next(iter(self.sender._unacked.values())))  # one gets stored...
                self.crash()  # ...and its ack is never read: the resend must be deduplicated
        client and client.close()

    def _turns(self) -> list[TurnSpec]:
        version = max(0, self.learner.version - int(self.rng.integers(0, 3)))  # some samples too stale
        if self.rng.random() < 0.4:
            return [TurnSpec(passed=True, score=1.0 + float(self.rng.random()), version=version)]
        return [
            TurnSpec(score=-1.0, version=version),
            TurnSpec(score=float(self.rng.uniform(-1, -0.5)), version=version),
        ]


class Learner(threading.Thread):
    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.version = 0
        self.trained: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        client, address = None, ""
        try:
            while self.version < STEPS:
                if client is None or Registry(self.run_dir).address("replay", "replay") != address:
                    client and client.close()
                    address = Registry(self.run_dir).address("replay", "replay")
                    client = RequestClient(address, timeout_s=1.0, retries=0)
                try:
                    reply = client.request(BatchRequest(learner_id="learner", version=self.version))
                except ChannelTimeout:
                    client.close()
                    client = None
                    continue
                if reply.status == "batch":
                    self.trained += list(dict.fromkeys(reply.batch.episode_ids))  # an id per sequence: once each
                    self.version += 1
                    time.sleep(0.1)  # a slow learner step
                elif reply.status == "wait":
                    time.sleep(reply.retry_after_s)
                else:
                    break
        except BaseException as err:  # noqa: BLE001 - surfaced by the test
            self.error = err
        finally:
            client and client.close()


def test_kill_9_of_the_replay_loses_no_episode(tmp_path):
    replay = ReplayProcess(tmp_path, tmp_path / "replay.log")
    replay.start()
    restarts: list[threading.Thread] = []

    def crash():  # kill -9 now; a new process comes up a moment later, on a new port
        replay.kill9()
        t = threading.Thread(target=lambda: (time.sleep(0.5), replay.start()), daemon=True)
        t.start()
        restarts.append(t)

    learner = Learner(tmp_path)
    producer = Producer(tmp_path, learner, crash)
    learner.start()
    producer.start()
    try:
        wait_for(lambda: learner.version >= 3, 60, "3 learner steps", poll_s=0.02)
        producer.crash_now.set()
        wait_for(lambda: len(replay.starts) >= 2, 60, "the first restart", poll_s=0.02)
        wait_for(lambda: learner.version >= 6, 60, "6 learner steps", poll_s=0.02)
        crash()  # second kill: wherever the run happens to be
        wait_for(lambda: len(replay.starts) >= 3, 60, "the second restart", poll_s=0.02)
        learner.join(timeout=90)
        assert not learner.is_alive() and learner.error is None and learner.version == STEPS
        producer.stop.set()
        producer.join(timeout=30)
        assert producer.error is None
        # a resend of an episode stored before the crashes is recognised after them
        old = next(iter(producer.made.values()))
        producer.sender.submit(old)
        assert producer.sender.flush(30), "episodes still unacknowledged"
    finally:
        producer.stop.set()
        replay.terminate()
    assert all(s["recovered"]["log_entries"] or s["recovered"]["snapshot"] for s in replay.starts[1:])
    stats = producer.sender.stats
    # Sends caught by a crash are re-sent (to the replacement at once, since a send's wait watches the
    # registry: no timeout needed); the ones replay had stored come back as duplicates.
    assert stats.duplicate >= 2 and not stats.rejected

    # open the run directory in-process and audit every episode id
    cfg = load_config(None, OVERRIDES)
    audit = ReplayActor(cfg.replay, cfg.algo, RunContext(run_dir=str(tmp_path)))
    ids = audit.episode_ids()
    h = audit.health()
    audit.stop()
    trained = set(ids.get("trained", []))
    filtered = {k: set(v) for k, v in ids.items() if k.startswith("filtered:")}
    pending = set(ids.get("pending", []))
    emitted = trained | pending | set().union(*filtered.values())
    assert emitted == set(producer.made), "every episode made is stored (and nothing else)"
    assert set(producer.sender.acked) == emitted
    assert trained == set(learner.trained) and len(learner.trained) == len(trained) == STEPS * B * G
    assert h.emitted == h.trained + h.filtered_total + h.pending == len(emitted)
    assert h.invariant_ok and h.learner_version == STEPS - 1  # the last batch was asked for at STEPS - 1
    assert filtered.get("filtered:stale"), "the run exercised the staleness filter"
