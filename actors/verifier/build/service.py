"""BuildService: capture and compile candidates in a pool of confined, warm-started children.

submit(source) -> Future[BuildResult]. Each job: look the whole source up in the capture cache;
else write it to a scratch dir, ask the zygote for a fresh child, and watch that child from a
service thread (wall-clock deadline, process count, resident memory of its whole tree) until the
zygote reports it reaped; then read its event log into a BuildResult (`results.assemble`).
At most `workers` children run at once. Precompiled headers are built here, in the background,
by the trusted process: the common variants at start-up, others when a child reports it missed one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from . import proctree
from .cache import ArtifactCache
from .capture import CANDIDATE_FILE
from .preludes import SHELL, PchStore, flag_profile
from .results import BuildResult, assemble, infra_result
from .toolchain import Toolchain

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
POLL_S = 0.02
MAX_PCH_VARIANTS = 6  # per prelude and service


class _Zygote:
    """The fork-server process and the thread that reads its replies."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "actors.verifier.build.zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT, env=env,
                                     start_new_session=True)
        self._lock = threading.Lock()
        self._waiters: dict[str, dict] = {}
        self.ready = threading.Event()
        self.dead = threading.Event()
        self._reader = threading.Thread(target=self._read, name="kiln-build-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if msg.get("ready"):
                self.ready.set()
                continue
            with self._lock:
                w = self._waiters.get(str(msg.get("job")))
            if w is None:
                continue
            if "pid" in msg:
                w["pid"] = int(msg["pid"])
                w["pid_event"].set()
            if "status" in msg:
                w["status"] = msg["status"]
                w["status_event"].set()
        with self._lock:
            self.dead.set()
            for w in self._waiters.values():
                w["pid_event"].set()
                w["status_event"].set()

    def spawn(self, request: dict) -> dict:
        w = {"pid": None, "status": None, "pid_event": threading.Event(), "status_event": threading.Event()}
        with self._lock:
            if self.dead.is_set():  # the reader has already released every waiter
                w["pid_event"].set()
                w["status_event"].set()
                return w
            self._waiters[request["job"]] = w
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        return w

    def forget(self, job: str) -> None:
        with self._lock:
            self._waiters.pop(job, None)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def default_pch_dir() -> Path:
    """Precompiled headers depend only on the toolchain, so one machine-wide directory serves every
    run and test session: $KILN_PCH_DIR, else $XDG_CACHE_HOME/kiln/pch, else ~/.cache/kiln/pch."""
    if os.environ.get("KILN_PCH_DIR"):
        return Path(os.environ["KILN_PCH_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln" / "pch"


class BuildService:
    """Compile pool of one verifier. Thread-safe; `close()` when done."""

    def __init__(self, cache_dir: Path, backend: str, workers: int, timeout_s: float, *,
                 memory_limit_mb: int = 8192, max_processes: int = 64, prelude_policy: str = "auto",
                 pch: str = "auto", pch_dir: Path | None = None, gpu_visible: bool = False,
                 start_timeout_s: float = 120.0) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("workers must be >= 1 and timeout_s > 0")
        if pch not in ("auto", "use"):
            raise ValueError("pch must be 'auto' (build common variants, then misses, in the background) "
                             "or 'use' (use variants already built, never build)")
        self.toolchain = Toolchain.detect(backend)
        self.toolchain_id = self.toolchain.id
        self.backend = backend
        self.cache_dir = Path(cache_dir)
        self.cache = ArtifactCache(self.cache_dir, self.toolchain.digest)
        self.pch = PchStore(Path(pch_dir) if pch_dir else default_pch_dir(), self.toolchain)
        self.pch_mode = pch
        self.jobs_dir = self.cache.root / "jobs"
        self.cache.remove_stale(older_than_s=86400)
        self.timeout_s = float(timeout_s)
        self.memory_limit = int(memory_limit_mb) << 20
        self.max_processes = int(max_processes)
        self.prelude_policy = prelude_policy
        self.gpu_visible = gpu_visible
        self._closed = False
        self._active: dict[str, int] = {}  # job -> pid of its child, for close()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-build")
        self._zygote_lock = threading.Lock()
        self._start_timeout = start_timeout_s
        self._zygote = self._start_zygote()
        self._pch_queue: queue.Queue = queue.Queue()
        self._pch_seen: set = set()
        self._pch_pending = 0
        self._pch_cond = threading.Condition()
        self._pch_thread = threading.Thread(target=self._pch_loop, name="kiln-build-pch", daemon=True)
        self._pch_thread.start()
        if pch == "auto":
            for prelude, profile in self.default_pch_variants():
                self.request_pch(prelude, profile)

    # ------------------------------------------------------------------------------ public API
    def submit(self, candidate_source: str) -> Future:
        """Capture and build one candidate; the future resolves to a BuildResult (never raises)."""
        if self._closed:
            raise RuntimeError("BuildService is closed")
        if not isinstance(candidate_source, str):
            fut: Future = Future()
            fut.set_result(infra_result("candidate source must be a string", self.toolchain_id, "runtime"))
            return fut
        return self._pool.submit(self._guarded_job, candidate_source)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pid in list(self._active.values()):  # running jobs end now, as "service closed"
            proctree.kill_tree(pid)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.pch.abort()
        self._pch_queue.put(None)
        self._pch_thread.join(timeout=10)
        with self._zygote_lock:
            self._zygote.close()

    def __enter__(self) -> "BuildService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def default_pch_variants(self) -> list[tuple[str, tuple[str, ...]]]:
        """Built at start-up: what nearly every candidate uses. The rest (no -O, -march=native,
        the full fallback prelude, ...) is built the first time a candidate misses it."""
        # lean serves kernel TUs and thunk bindings (CUDA kernels go to nvcc, which has no PCH);
        # the shell is the one pybind11 object all thunk-bound extensions link.
        return [("lean", flag_profile(["-O3"])), (SHELL, ())]

    def request_pch(self, prelude: str, profile: tuple[str, ...], force: bool = False) -> None:
        """Queue a precompiled-header variant for background building (once per service).
        With pch='use' only `force=True` (benchmarks, tests) builds."""
        item = (prelude, tuple(profile))
        if item in self._pch_seen or not self.toolchain.cxx_is_gcc or (self.pch_mode != "auto" and not force):
            return
        if not force and sum(p == prelude for p, _ in self._pch_seen) >= MAX_PCH_VARIANTS:
            return  # each variant is hundreds of MB: a stream of exotic flag sets gets none
        self._pch_seen.add(item)
        with self._pch_cond:
            self._pch_pending += 1
        self._pch_queue.put(item)

    def wait_pch(self, timeout_s: float | None = None) -> bool:
        """Block until every queued PCH variant is built (benchmarks use this); True when idle."""
        with self._pch_cond:
            return self._pch_cond.wait_for(lambda: self._pch_pending == 0, timeout_s)

    # ------------------------------------------------------------------------------ jobs
    def _guarded_job(self, source: str) -> BuildResult:
        try:
            return self._job(source)
        except Exception as e:  # noqa: BLE001 - the future must always carry a BuildResult
            log.exception("build job failed")
            return infra_result(f"build service error: {type(e).__name__}: {e}", self.toolchain_id)

    def _job(self, source: str) -> BuildResult:
        t0 = time.monotonic()
        source_key = hashlib.sha256(f"{self.toolchain_id}\n{self.prelude_policy}\n{source}".encode()).hexdigest()[:32]
        cached = self._cached_capture(source_key, t0)
        if cached is not None:
            return cached
        job = uuid.uuid4().hex[:16]
        scratch = self.jobs_dir / job
        scratch.mkdir(parents=True)
        try:
            (scratch / CANDIDATE_FILE).write_text(source)
            request = {"job": job, "scratch": str(scratch), "cache_dir": str(self.cache_dir),
                       "pch_dir": str(self.pch.root.parent), "toolchain": self.toolchain.to_dict(),
                       "memory_limit_bytes": self.memory_limit, "prelude_policy": self.prelude_policy,
                       "gpu_visible": self.gpu_visible}
            outcome = self._run_child(request)
            result, pch_wanted = assemble(scratch, outcome, self.toolchain_id, self.timeout_s)
            result.seconds = time.monotonic() - t0
            result.phases["fork"] = outcome.get("fork_s", 0.0)
            for prelude, profile in pch_wanted:
                if isinstance(prelude, str) and isinstance(profile, list):
                    self.request_pch(prelude, tuple(str(f) for f in profile))
            if result.ok or result.error_class == "compile":
                self.cache.store_capture(source_key, result.to_dict())
            return result
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _cached_capture(self, source_key: str, t0: float) -> BuildResult | None:
        data = self.cache.load_capture(source_key)
        if data is None:
            return None
        try:
            result = BuildResult.from_dict(data)
        except (KeyError, TypeError, ValueError):
            return None
        if not all(os.path.isfile(p) for p in result.artifacts.values()):
            return None  # an artifact was evicted: capture again
        result.cached = True
        result.seconds = time.monotonic() - t0
        result.phases = {"cache": result.seconds}
        return result

    def _run_child(self, request: dict) -> dict:
        """Fork a child via the zygote and watch it; returns what happened to it."""
        zygote = self._ensure_zygote()
        t_fork = time.monotonic()
        waiter = zygote.spawn(request)
        try:
            if not waiter["pid_event"].wait(30) or waiter["pid"] is None:
                return {"infra": "the compile zygote did not start a child"}
            pid = waiter["pid"]
            self._active[request["job"]] = pid
            fork_s = time.monotonic() - t_fork
            verdict = self._watch(pid, waiter["status_event"])
            try:  # leftovers of the child's session (background processes it started)
                os.killpg(pid, 9)
            except OSError:
                pass
            if zygote.dead.is_set() and waiter["status"] is None:
                return {"infra": "the compile zygote died"}
            if self._closed and verdict is None and (waiter["status"] or {}).get("signal") == 9:
                return {"infra": "the build service was closed while this candidate was building"}
            return {"status": waiter["status"], "killed": verdict, "fork_s": fork_s,
                    "limits": {"memory_bytes": self.memory_limit, "processes": self.max_processes}}
        finally:
            self._active.pop(request["job"], None)
            zygote.forget(request["job"])

    def _watch(self, pid: int, reaped: threading.Event) -> str | None:
        """Poll the child's process tree until the zygote reaps it; kill the tree past a limit.
        Returns what it was killed for (timeout, processes, memory), or None."""
        deadline = time.monotonic() + self.timeout_s
        while not reaped.wait(POLL_S):
            pids = proctree.descendants(pid, limit=self.max_processes + 1)
            verdict = None
            if time.monotonic() > deadline:
                verdict = "timeout"
            elif len(pids) > self.max_processes:
                verdict = "processes"
            elif proctree.tree_rss(pids) > self.memory_limit:
                verdict = "memory"
            if verdict:
                proctree.kill_tree(pid)
                reaped.wait(10)
                return verdict
        return None

    # ------------------------------------------------------------------------------ zygote + pch
    def _zygote_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _start_zygote(self) -> _Zygote:
        z = _Zygote(self._zygote_env())
        if not z.ready.wait(self._start_timeout) or z.dead.is_set():
            z.close()
            raise RuntimeError("the compile zygote did not start (python -m actors.verifier.build.zygote)")
        return z

    def _ensure_zygote(self) -> _Zygote:
        with self._zygote_lock:
            if self._zygote.dead.is_set() or self._zygote.proc.poll() is not None:
                log.warning("compile zygote died; starting a new one")
                self._zygote.close()
                self._zygote = self._start_zygote()
            return self._zygote

    def _pch_loop(self) -> None:
        while True:
            item = self._pch_queue.get()
            if item is None:
                return
            prelude, profile = item
            try:
                seconds = self.pch.build(prelude, profile, nice=5)
                if seconds:
                    log.info("precompiled %s prelude %s in %.1f s", prelude, " ".join(profile), seconds)
            except (RuntimeError, ValueError, OSError) as e:
                log.warning("precompiled header %s %s not built: %s", prelude, profile, e)
            with self._pch_cond:
                self._pch_pending -= 1
                self._pch_cond.notify_all()
