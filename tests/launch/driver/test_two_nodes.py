"""Two Ray nodes on one machine: a head and a worker, each a raylet of its own started by
launch/cluster/start_head.sh and start_worker.sh, and `kiln train` joining them (`cluster.address`) with
its actors on both nodes (`cluster.prefer_nodes`). The worker node is killed mid-run: its actors
restart on the head and the run finishes every step.

Where an actor runs is the node whose raylet started its process (the process's parent), the actor
known by the class Ray names its process after (`ray::RolloutActor`). The run's driver is a process of
its own (`python -m launch.cli train`): a test process may already be attached to the suite's local
Ray (`ray_session`), and a driver there would use that instead of joining.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.driver.run_dir import RunDirectory
from tests.launch.driver.test_train import TEXT_MATCH, versions

pytestmark = pytest.mark.slow

ROLE_OF_CLASS = {
    "ReplayActor": "replay",
    "LearnerActor": "learner",
    "VerifierActor": "verifier",
    "RolloutActor": "rollout",
}
ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ROOT / "launch" / "cluster"
NODE_START_S = 90.0
RUN_S = 240.0
KILL_AFTER_STEP = 3
TOTAL_STEPS = 12
# The GCS (on the head) health-checks every raylet: a killed one fails its checks at once, and these
# mark its node dead after about 3 s instead of Ray's default of about 15 s.
FAST_NODE_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_timeout_ms": "5000",
}


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on this machine now (bound at once, then released)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class RayNode:
    """One node: its `ray start --block`, in a session of its own, which every process of the node (the
    raylet, its agents, its actors' workers) shares."""

    name: str
    process: subprocess.Popen
    log: Path  # its `ray start`'s output

    def pids(self) -> list[int]:
        """Every live process of the node (zombies, already dead, left out)."""
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.getsid(int(entry)) == self.process.pid and state(int(entry)) not in "Z":
                    found.append(int(entry))
            except OSError:  # gone meanwhile
                continue
        return found

    def raylet(self) -> int | None:
        """The node's raylet: the process that starts the node's workers, Kiln's actors among them."""
        return next((pid for pid in self.pids() if read_proc(pid, "comm").strip() == "raylet"), None)

    def kill(self) -> None:
        """The node lost at once: SIGKILL to every process of it. Also how a node is stopped at the end:
        on SIGTERM, `ray start --block` takes over 10 s to stop its processes one by one."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        self.process.wait(timeout=10)


def read_proc(pid: int, what: str) -> str:
    try:
        return (Path("/proc") / str(pid) / what).read_text()
    except OSError:  # gone
        return ""


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the name: state, ppid, ... (the name may hold spaces and parentheses)."""
    return read_proc(pid, "stat").rpartition(")")[2].split()


def state(pid: int) -> str:
    fields = stat_fields(pid)
    return fields[0] if fields else "Z"


def parent(pid: int) -> int:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else 0


@dataclass
class TwoNodes:
    address: str  # the head's GCS, for cluster.address
    env: dict[str, str]  # for a driver: the cluster's auth token, and token mode (Ray turns it on by
    # itself only for address=auto, never for an address given: it sends no token there unasked)
    head: RayNode
    worker: RayNode

    def placement(self) -> dict[str, list[str]]:
        """On which node each Kiln actor runs: its role, by the class Ray names the actor's process after
        (`ray::RolloutActor`), mapped to the node whose raylet started that process (one entry per
        process: a role with two processes shows twice)."""
        found: dict[str, list[str]] = {}
        for node in (self.head, self.worker):
            raylet = node.raylet()
            for pid in node.pids():
                title = read_proc(pid, "cmdline").split("\0")[0].strip()
                cls = title.removeprefix("ray::").split(".")[0]  # "ray::RolloutActor.health" during a call
                if title.startswith("ray::") and cls in ROLE_OF_CLASS and parent(pid) == raylet:
                    found.setdefault(ROLE_OF_CLASS[cls], []).append(node.name)
        return found


def started(node: RayNode) -> bool:
    """`ray start` says so once the node has joined the cluster (its raylet registered with the GCS)."""
    return "Ray runtime started" in node.log.read_text()


def start_node(name: str, script: Path, args: list[str], env: dict[str, str], log: Path) -> RayNode:
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(script), *args, "--block"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return RayNode(name, process, log)


def wait_for(what: str, ready, process: subprocess.Popen, timeout_s: float = NODE_START_S):
    """`ready()`'s first true value, looked for every 0.5 s while `process` runs."""
    deadline, error = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited ({process.returncode}) before {what}")
        try:
            value = ready()
        except Exception as err:  # noqa: BLE001 - not up yet, however it fails
            value, error = None, err
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"no {what} within {timeout_s:g} s (last error: {error!r})")


@pytest.fixture
def two_nodes() -> Iterator[TwoNodes]:
    """A head and a worker node on this machine, 1 CPU and 200 MB of object store each, labelled
    kiln-node=head / kiln-node=worker, with an auth token of their own; at the end, however the test
    ends, every process of theirs is killed and their directory removed."""
    # Short: Ray's sockets live under it (a Unix socket path is at most 107 bytes).
    temp = Path(tempfile.mkdtemp(prefix="kiln-ray-", dir="/tmp"))
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    gcs, dashboard, client, agent, head_metrics, worker_agent, worker_metrics = free_ports(7)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env |= {"RAY_AUTH_TOKEN_PATH": str(token), "KILN_NODE_IP": "127.0.0.1", "KILN_RAY_PORT": str(gcs)}
    env |= {"KILN_DASHBOARD_PORT": str(dashboard), "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=1", "--object-store-memory=200000000", "--include-log-monitor=false"]
    nodes: list[RayNode] = []
    try:
        head = start_node(
            "head",
            SCRIPTS / "start_head.sh",
            [
                *common,
                f"--temp-dir={temp / 'head'}",
                "--labels=kiln-node=head",
                f"--ray-client-server-port={client}",
                f"--dashboard-agent-listen-port={agent}",
                f"--metrics-export-port={head_metrics}",
            ],
            env | FAST_NODE_DEATH,
            temp / "head.log",
        )
        nodes.append(head)
        wait_for("the head node", lambda: started(head), head.process)
        address = f"127.0.0.1:{gcs}"
        worker = start_node(
            "worker",
            SCRIPTS / "start_worker.sh",
            [
                address,
                *common,
                f"--temp-dir={temp / 'worker'}",
                "--labels=kiln-node=worker",
                f"--dashboard-agent-listen-port={worker_agent}",
                f"--metrics-export-port={worker_metrics}",
            ],
            env,
            temp / "worker.log",
        )
        nodes.append(worker)
        wait_for("the worker node", lambda: started(worker), worker.process)
        yield TwoNodes(address, env | {"RAY_AUTH_MODE": "token"}, head, worker)
    finally:
        for node in reversed(nodes):
            node.kill()
        for node in nodes:
            print(f"--- {node.name} node's log\n" + node.log.read_text()[-2000:])
        shutil.rmtree(temp, ignore_errors=True)


def test_a_run_on_two_nodes_survives_losing_the_worker_node(tmp_path, two_nodes):
    # Replay and the learner prefer the head, the verifier and the rollout actor the worker. No
    # standbys: a rollout's spare would sit on the worker too and die with it, and on 2 cores each
    # spare process slows the run.
    run_dir = tmp_path / "two-nodes"
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "train",
        "--config",
        str(TEXT_MATCH),
        f"logging.root={tmp_path}",
        "logging.run_name=two-nodes",
        "logging.live=false",
        f"cluster.address={two_nodes.address}",
        "cluster.prefer_nodes.replay=kiln-node=head",
        "cluster.prefer_nodes.learner=kiln-node=head",
        "cluster.prefer_nodes.verifier=kiln-node=worker",
        "cluster.prefer_nodes.rollout=kiln-node=worker",
        f"algo.total_steps={TOTAL_STEPS}",
        "rollout.standby=false",
        "learner.standby=false",
    ]
    began = time.monotonic()
    with (tmp_path / "driver.log").open("w") as log:
        driver = subprocess.Popen(
            cmd, cwd=ROOT, env=two_nodes.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(
            f"step {KILL_AFTER_STEP}",
            lambda: max(versions(RunDirectory(run_dir)), default=0) >= KILL_AFTER_STEP,
            driver,
            RUN_S,
        )
        before = two_nodes.placement()
        assert before == {"replay": ["head"], "learner": ["head"], "verifier": ["worker"], "rollout": ["worker"]}
        two_nodes.worker.kill()
        killed_at = time.monotonic()
        everyone_on_head = {role: ["head"] for role in ROLE_OF_CLASS.values()}
        after = wait_for(
            "the worker's actors restarted on the head",
            lambda: (now := two_nodes.placement()) == everyone_on_head and now,
            driver,
            RUN_S,
        )
        assert driver.wait(timeout=RUN_S) == 0, (tmp_path / "driver.log").read_text()[-5000:]
        finished = time.monotonic()
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    print(f"before the kill: {before}\nafter: {after}")
    print(f"the run took {finished - began:.1f} s, {finished - killed_at:.1f} s of it after the kill")
    assert after == everyone_on_head
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {r["actor"] for r in summary["restarts"]} == {"verifier-0", "rollout-0"}, summary["restarts"]
    seen = versions(RunDirectory(run_dir))
    assert seen == sorted(set(seen)) and seen[-1] >= TOTAL_STEPS, seen
    assert summary["learner"]["version"] >= TOTAL_STEPS
    ep = summary["episodes"]
    assert ep["invariant_ok"] and ep["emitted"] == ep["trained"] + ep["filtered_total"] + ep["pending"]
    assert (run_dir / "final" / "config.json").exists()
