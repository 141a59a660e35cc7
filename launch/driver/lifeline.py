"""The driver's lifeline: when the `kiln` process ends, however it ends (SIGKILL included), every
process it started ends within seconds.

Each part has a parent-death mechanism of its own: the verifier's zygote exits when its control
socket closes, wardens and sandboxes carry PR_SET_PDEATHSIG (re-armed after a uid change), the
baseline worker exits when its stdin closes, Ray's workers die with their raylet. Processes that a
library starts have only what the library gives them, and that is not always enough: after a
SIGKILL of the driver, Ray's dashboard and runtime-env agents notice their raylet is gone, then hang
reporting it to a GCS that is gone too, and run on for good. The lifeline is the net under them all:

* `held()` puts a fresh token in the driver's environment (`KILN_LIFELINE`) before anything starts.
  Every process the driver starts inherits it, and so does every process those start: a forked
  process (a zygote's sandbox) keeps it in /proc/PID/environ whatever it later does to its own
  environment, or to its uid. A program a build jail runs with an environment of its own lives in
  that jail's PID namespace and dies with it.
* A process that rewrites its title (Ray's `ray::DashboardAgent`, setproctitle) overwrites that
  memory, so the keeper also notes the driver's process tree every SNAPSHOT_S (pid and start time:
  a pid reused since is not taken for the process noted). A process that outlived the driver has
  been reparented to init by then, so it is found by the note, not by the tree.
* A keeper process (`python -m launch.driver.lifeline`), started first, in a session of its own (a
  terminal's Ctrl-C or a kill of the driver's process group does not reach it), holds the read end of
  a pipe whose only write end is the driver's (close-on-exec: no child holds it). EOF on the pipe
  means the driver is gone or done (one that returns writes DONE first: its sweep is silent); the
  keeper then SIGKILLs every process that carries the token or was noted, and everything below
  them, until none is left (at most KEEPER_SWEEP_S), and exits. It never kills itself, or the driver
  (a token set after exec is not in /proc/PID/environ).

Only the process's own command line holds a lifeline (`launch/cli/main.py`): a test that calls the
CLI's main() in-process must not have its session's processes swept when that call returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from actors.verifier.proctree import descendants

ENV = "KILN_LIFELINE"
DONE = b"D"  # the driver's one word on the pipe, as it returns
SNAPSHOT_S = 0.5  # how often the keeper notes the driver's process tree
KEEPER_SWEEP_S = 8.0  # a SIGKILLed process is gone in milliseconds; one in uninterruptible sleep may take longer
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger(__name__)


@contextlib.contextmanager
def held() -> Iterator[str | None]:
    """Start the keeper and mark this process's future children with its token (yielded; None when
    the keeper could not start, which is logged and otherwise ignored: the parts' own mechanisms
    still hold). On the way out the pipe closes and the keeper's sweep is waited for, so the command
    returns once nothing it started is left."""
    token = secrets.token_hex(8)
    read, write = os.pipe()  # both close-on-exec: the keeper gets `read` through pass_fds only
    env = {k: v for k, v in os.environ.items() if k != ENV}  # an outer driver's token marks us, not it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    try:
        keeper = subprocess.Popen(
            [sys.executable, "-m", "launch.driver.lifeline", str(read), token, str(os.getpid())],
            pass_fds=[read],
            env=env,
            cwd=_ROOT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as err:
        log.warning("no lifeline keeper (%s): processes of a killed run may outlive it", err)
        os.close(read)
        os.close(write)
        yield None
        return
    os.close(read)
    before = os.environ.get(ENV)
    os.environ[ENV] = token
    try:
        yield token
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        os.write(write, DONE)  # a run that ended by itself: the keeper sweeps without a word
        os.close(write)
        try:
            keeper.wait(timeout=KEEPER_SWEEP_S + 2)
        except subprocess.TimeoutExpired:
            keeper.kill()


# ------------------------------------------------------------------------------------ the keeper


def marked(token: str, me: int) -> list[int]:
    """Every process but `me` whose initial environment holds KILN_LIFELINE=token."""
    needle = f"\0{ENV}={token}\0".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":
                    out.append(int(name))
        except OSError:  # gone, or not ours to read (a non-root sandbox: its warden takes it)
            continue
    return out


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot; /proc/PID/stat field 22), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class Keeper:
    """What the keeper knows of the driver's processes, and how it ends them."""

    def __init__(self, token: str, driver: int) -> None:
        self.token, self.driver, self.me = token, driver, os.getpid()
        # The driver as this keeper's parent knew it: a driver gone before the keeper looked, or a pid
        # reused since, is no tree to note (pid 1's would be every process on the machine).
        self.driver_started = start_time(driver) if os.getppid() == driver else None
        self.noted: dict[int, int] = {}  # pid -> start time, every process seen below the driver

    def note(self) -> None:
        if self.driver_started is None or start_time(self.driver) != self.driver_started:
            return
        for pid in descendants(self.driver)[1:]:
            if pid != self.me and pid not in self.noted and (t := start_time(pid)) is not None:
                self.noted[pid] = t

    def left(self) -> set[int]:
        """Processes of the driver still running: marked or noted, and all below them."""
        tops = set(marked(self.token, self.me))
        tops |= {pid for pid, t in self.noted.items() if start_time(pid) == t}
        out = set()
        for pid in tops:
            out.update(descendants(pid))
        out.discard(self.me)
        out.discard(self.driver)
        return out

    def sweep(self, within_s: float = KEEPER_SWEEP_S) -> list[int]:
        """SIGKILL what is left until nothing is (or `within_s` passed); returns those killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + within_s
        while (left := self.left()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except OSError:
                    pass
            time.sleep(0.05)
        return sorted(killed)


def main(argv: list[str]) -> int:
    fd, token, driver = int(argv[0]), argv[1], int(argv[2])
    keeper = Keeper(token, driver)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's EOF ends the keeper's watch
    finished = False  # the driver wrote DONE: it ended by itself, and said what it had to say
    while True:
        keeper.note()
        if select.select([fd], [], [], SNAPSHOT_S)[0]:
            data = os.read(fd, 64)
            if not data:
                break
            finished = finished or DONE in data
    killed = keeper.sweep()
    if killed and not finished:
        print(f"kiln lifeline: the driver is gone; ended {len(killed)} process(es) it left", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
