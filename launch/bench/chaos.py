"""`kiln bench CONFIG --chaos N`: one training run, killed N times, each role in turn, the driver included.

A controller outside the run starts `kiln train` (Ray: every actor is a process of its own) and
watches RUN_DIR/metrics.jsonl. Each time the run has made a step since the last recovery, it kills
one role with SIGKILL or SIGTERM (alternating): an actor's process is found in the run's registry
(RUN_DIR/registry.json records each actor's pid); the driver is the `kiln train` process, and after
it is gone the controller checks that nothing the driver started is left (its lifeline,
launch/driver/lifeline.py) and continues with `kiln train --resume RUN_DIR`. Roles are drawn from a
seeded shuffle of every role, so each is hit once per round.

Reported per kill: the role, the signal, the step it followed, the recovery (kill to the next learner
step recorded; for the driver, to the resumed session's first step) and that recovery in median step
intervals (of the steps before the kill); at the end the run's no-loss check (summary.json's
`id_check`, launch/observe/id_check.py) and the processes left behind. Written to OUT/chaos.json and
printed as a table.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.driver.lifeline import ENV as LIFELINE_ENV

ROLES = ("driver", "replay", "learner", "verifier-0", "rollout-0")
SIGNALS = (signal.SIGKILL, signal.SIGTERM)
ROOT = Path(__file__).resolve().parents[2]
STEP_WAIT_S = 900.0  # a step (or a resumed run's first step) later than this ends the chaos run as failed
ORPHAN_WAIT_S = 10.0  # the no-orphan promise: everything the driver started is gone this long after it


@dataclass
class Kill:
    role: str
    signal: str
    after_step: int
    at: float  # wall clock
    recovery_s: float | None = None  # to the next learner step recorded
    step_interval_s: float | None = None  # the median interval of the steps before the kill
    left_behind: list[str] = field(default_factory=list)  # the driver's processes alive ORPHAN_WAIT_S after it

    @property
    def in_steps(self) -> float | None:
        if self.recovery_s is None or not self.step_interval_s:
            return None
        return self.recovery_s / self.step_interval_s


@dataclass
class ChaosResult:
    config: str
    kills: list[Kill]
    finished: bool
    steps: int
    id_check: dict
    sessions: int
    left_at_end: list[str]
    wall_s: float


class ChaosError(RuntimeError):
    pass


class Chaos:
    def __init__(self, config: str, kills: int, out: Path, overrides: list[str], seed: int) -> None:
        self.out, self.n, self.rng = out, kills, random.Random(seed)
        out.mkdir(parents=True, exist_ok=True)
        self.run_dir = out / "chaos"
        self.train_cmd = [
            *(sys.executable, "-m", "launch.cli", "train", "--config", config),
            "cluster.use_ray=true",  # every actor a process of its own, so one can be killed alone
            f"logging.root={out}",
            "logging.run_name=chaos",
            "logging.live=false",
            *overrides,
        ]
        self.driver: subprocess.Popen | None = None
        self.sessions = 0

    # ---------------------------------------------------------------------------- the run

    def start_driver(self, resume: bool) -> None:
        cmd = [sys.executable, "-m", "launch.cli", "train", "--resume", str(self.run_dir)] if resume else self.train_cmd
        self.sessions += 1
        log = (self.out / f"driver-{self.sessions}.log").open("w")
        # Its own session: the controller's terminal signals and kills never reach it by accident.
        self.driver = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def steps(self) -> list[tuple[int, float]]:
        """(step, wall time) of every learner step row so far."""
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return []
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a row being written
            if "train/loss" in row and isinstance(row.get("time"), (int, float)):
                rows.append((int(row["step"]), float(row["time"])))
        return rows

    def wait_for_step(self, after: float) -> float:
        """The wall time of the first step recorded after `after`; raises when the run ends or stalls."""
        deadline = time.monotonic() + STEP_WAIT_S
        while time.monotonic() < deadline:
            later = [t for _, t in self.steps() if t > after]
            if later:
                return min(later)
            if self.driver.poll() is not None:
                raise ChaosError(f"kiln train ended ({self.driver.returncode}) waiting for a step")
            time.sleep(0.2)
        raise ChaosError(f"no learner step within {STEP_WAIT_S:.0f} s")

    def pid_of(self, role: str) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                entry = json.loads((self.run_dir / "registry.json").read_text()).get(role)
            except (OSError, ValueError):
                entry = None
            if entry and entry.get("pid") and entry["pid"] != self.driver.pid:
                return int(entry["pid"])
            time.sleep(0.2)
        raise ChaosError(f"{role} is not in the run's registry (is cluster.use_ray on?)")

    # ---------------------------------------------------------------------------- kills

    def kill(self, role: str, sig: signal.Signals) -> Kill:
        steps = self.steps()
        times = [t for _, t in steps[-6:]]
        interval = statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else None
        k = Kill(role, sig.name, steps[-1][0] if steps else 0, time.time(), step_interval_s=interval)
        if role == "driver":
            self.driver.send_signal(sig)
            try:
                self.driver.wait(timeout=300)  # SIGTERM: it checkpoints and stops everything first
            except subprocess.TimeoutExpired:
                self.driver.kill()
                self.driver.wait()
            time.sleep(ORPHAN_WAIT_S)
            k.left_behind = left_behind()
            self.start_driver(resume=True)
        else:
            os.kill(self.pid_of(role), sig)
        k.recovery_s = self.wait_for_step(k.at) - k.at
        return k

    def plan(self) -> list[tuple[str, signal.Signals]]:
        roles: list[str] = []
        while len(roles) < self.n:
            round_ = list(ROLES)
            self.rng.shuffle(round_)
            roles += round_
        return [(role, SIGNALS[i % 2]) for i, role in enumerate(roles[: self.n])]

    def run(self) -> ChaosResult:
        started = time.time()
        kills: list[Kill] = []
        self.start_driver(resume=False)
        try:
            last = self.wait_for_step(0.0)
            for role, sig in self.plan():
                last = self.wait_for_step(last)  # a step since the last recovery: the run is going again
                kills.append(self.kill(role, sig))
                last = kills[-1].at + kills[-1].recovery_s
                print(f"chaos: {role} {sig.name} -> next step after {kills[-1].recovery_s:.1f} s", flush=True)
            finished = self.driver.wait(timeout=STEP_WAIT_S * 2) == 0
        except (ChaosError, subprocess.TimeoutExpired, KeyboardInterrupt) as err:
            print(f"chaos: stopped: {err}", flush=True)
            finished = False
        finally:
            if self.driver.poll() is None:
                self.driver.send_signal(signal.SIGTERM)
                try:
                    self.driver.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    self.driver.kill()
        time.sleep(ORPHAN_WAIT_S)
        summary = _read_json(self.run_dir / "summary.json")
        return ChaosResult(
            config=" ".join(self.train_cmd[5:]),
            kills=kills,
            finished=finished,
            steps=(summary.get("learner") or {}).get("step", 0),
            id_check=summary.get("id_check") or {},
            sessions=len(summary.get("sessions") or []),
            left_at_end=left_behind(),
            wall_s=time.time() - started,
        )


def left_behind() -> list[str]:
    """Processes started by some driver (their environment carries a lifeline token) other than this
    controller's own: `pid command`."""
    mine = os.environ.get(LIFELINE_ENV)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        tokens = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(LIFELINE_ENV.encode() + b"=")]
        if tokens and tokens[0] != mine:
            found.append(f"{name} {cmdline.strip()[:80]}")
    return found


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def render(r: ChaosResult) -> str:
    lines = [
        "| # | role | signal | after step | recovery s | in median steps | left behind |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, k in enumerate(r.kills, 1):
        rec = f"{k.recovery_s:.1f}" if k.recovery_s is not None else "-"
        ratio = f"{k.in_steps:.2f}" if k.in_steps is not None else "-"
        left = str(len(k.left_behind)) if k.role == "driver" else ""
        lines.append(f"| {i} | {k.role} | {k.signal} | {k.after_step} | {rec} | {ratio} | {left} |")
    actor = [k.in_steps for k in r.kills if k.role != "driver" and k.in_steps is not None]
    driver = [k.recovery_s for k in r.kills if k.role == "driver" and k.recovery_s is not None]
    check = r.id_check
    head = f"finished: {r.finished} at step {r.steps} over {r.sessions} sessions in {r.wall_s:.0f} s"
    if actor:
        head += f"; median actor recovery {statistics.median(actor):.2f} step intervals"
    if driver:
        head += f"; driver kill to the resumed run's first step: median {statistics.median(driver):.0f} s"
    verdict = "holds" if check.get("ok") else "FAILS " + json.dumps(check.get("problems"))
    lines += [
        "",
        head,
        (
            f"id check: {verdict}: {check.get('acked')} acknowledged, {check.get('trained')} trained, "
            f"{check.get('filtered')} filtered, {check.get('pending')} pending; "
            f"processes left at the end: {len(r.left_at_end)}"
        ),
    ]
    return "\n".join(lines)


def chaos(config: str, kills: int, out: Path, overrides: list[str], seed: int = 0) -> ChaosResult:
    result = Chaos(config, kills, out, overrides, seed).run()
    (out / "chaos.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
    print(render(result))
    return result
