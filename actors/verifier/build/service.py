"""BuildService: capture and compile candidates, every step of it jailed, the cache written only here.

submit(source) -> Future[BuildResult]. Each job: look the whole source up in the capture cache;
else write it to a scratch dir and fork a *capture* process from the zygote (jailed like any process
that runs candidate code), watched from a service thread (wall-clock deadline, process count,
resident memory of its whole tree). The capture process asks for each `load_inline` call to be
built; the service has it built (extension_builds.py: from the artifact cache, or compiled in a
jailed *build* process, symbol-checked and published only without a finding), links it into the
job's own library directory and answers with its path there: the capture process
sees that directory alone, at a neutral path (jail.LIBDIR), never the cache. Nothing but this
service writes the cache, which is bounded (`cache_bytes`, least recently used first, never an entry
in use). At most `workers` jobs run at once.

What a capture process sends is bounded before it is kept: a message (MAX_EVENT_BYTES, and
wire.MAX_ITEMS decoded objects), all its messages (MAX_CAPTURE_BYTES, MAX_CAPTURE_EVENTS: past
either it is killed, a runtime error of the candidate's), its load_inline calls (MAX_BUILDS, their
sources MAX_SOURCE_BYTES), the text kept from each event (MAX_TEXT), one event of each kind.
Precompiled headers are built in the background by the trusted process (pch_builds.py): the common
variants at start-up, others when a build reports it missed one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Self

from actors.verifier import isolation, wire
from actors.verifier.zygote import Zygote, ZygoteError

from . import symbols
from .cache import DEFAULT_MAX_BYTES, ArtifactCache, Pins
from .capture import CANDIDATE_FILE
from .extension_builds import MAX_TEXT, ExtensionBuilds
from .pch_builds import PchBuilds, default_pch_dir, default_variants
from .preludes import FENCE, NATIVE, PchStore
from .results import BuildResult, assemble, infra_result
from .spec import ExtensionSpec, UnsupportedCall, check_flags
from .toolchain import Toolchain
from .watch import TreeWatch, read_evidence

log = logging.getLogger(__name__)

MAX_EVENT_BYTES = 8 << 20  # one message of a capture process (a load_inline call carries its sources)
MAX_CAPTURE_EVENTS = 10_000  # a capture process that sends more is killed
MAX_CAPTURE_BYTES = 64 << 20  # all messages of one capture process: one that sends more is killed
MAX_BUILDS = 32  # load_inline calls of one candidate
MAX_SOURCE_BYTES = 8 << 20  # the sources and flags of its distinct load_inline calls, together
# The candidate's events that are kept (the first of each kind; the rest carry nothing new), and the
# fields of each: nothing else a capture process sent survives its conversation.
KEPT_EVENTS = {
    "exception": ("type", "message", "traceback"),
    "unsupported": ("message",),
    "import_error": ("name", "message"),
    "done": ("seconds", "compile_seconds"),
}


class BuildService:
    """Compile pool of one verifier. Thread-safe; `close()` when done."""

    def __init__(
        self,
        cache_dir: Path,
        backend: str,
        workers: int,
        timeout_s: float,
        *,
        memory_limit_mb: int = 8192,
        max_processes: int = 64,
        prelude_policy: str = "auto",
        pch: str = "auto",
        pch_dir: Path | None = None,
        gpu_visible: bool = False,
        device: dict | None = None,
        start_timeout_s: float = 120.0,
        zygote: Zygote | None = None,
        cache_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("workers must be >= 1 and timeout_s > 0")
        if pch not in ("auto", "use"):
            raise ValueError(
                "pch must be 'auto' (build common variants, then misses, in the background) "
                "or 'use' (use variants already built, never build)"
            )
        self.toolchain = Toolchain.detect(backend)
        self.toolchain_id = self.toolchain.id
        self.backend = backend
        self.cache_dir = Path(cache_dir)
        self.cache = ArtifactCache(self.cache_dir, self.toolchain.digest)
        self.pch = PchStore(Path(pch_dir) if pch_dir else default_pch_dir(), self.toolchain)
        self.jobs_dir = self.cache.root / "jobs"
        self.cache.remove_stale(older_than_s=86400)
        self.cache_bytes = int(cache_bytes)
        self.timeout_s = float(timeout_s)
        self.memory_limit = int(memory_limit_mb) << 20
        self.max_processes = int(max_processes)
        self.prelude_policy = prelude_policy
        self.gpu_visible = gpu_visible
        self.device = device  # the GPU that module-level device queries are answered about (devices.py)
        self._closed = False
        self._active: dict = {}  # job -> its running capture process (zygote.Spawned), for close()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-build")
        self.own_zygote = zygote is None
        self.zygote = zygote or Zygote(start_timeout_s)
        self.extensions = ExtensionBuilds(
            self.toolchain,
            self.cache,
            self.cache_dir,
            self.pch,
            self.zygote,
            timeout_s=self.timeout_s,
            max_processes=self.max_processes,
            memory_limit=self.memory_limit,
            prelude_policy=prelude_policy,
            hidden=self._hidden(),
        )
        if not self.zygote.started:  # the sandbox's native parts: every jailed process gets them
            self.zygote.native_library, self.zygote.fence_library = self._native_parts()
        try:
            self.zygote.start()
        except ZygoteError as err:
            raise RuntimeError(f"the compile stage's zygote did not start: {err}") from None
        self.pch_builds = PchBuilds(self.pch, self.toolchain, pch)
        if pch == "auto":
            for prelude, profile in self.default_pch_variants():
                self.request_pch(prelude, profile)

    def _native_parts(self) -> tuple[str, str | None]:
        """Build (once per toolchain and machine, like a precompiled header) the sandbox's native
        module, which the jail cannot do without (RuntimeError when it does not build), and the
        compute fence (None, with a warning, when it does not build: the layer is then reported
        missing in every verdict)."""
        try:
            self.pch.build(NATIVE, ())
        except (RuntimeError, OSError) as err:
            raise RuntimeError(f"the sandbox's native module (kiln_native) did not build: {err}") from None
        try:
            seconds = self.pch.build(FENCE, ())
            if seconds:
                log.info("built the compute fence in %.1f s", seconds)
            fence = str(self.pch.fence_module())
        except (RuntimeError, OSError) as err:
            log.warning("the compute fence did not build: %s", err)
            fence = None
        return str(self.pch.native_module()), fence

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
        for spawned in list(self._active.values()):  # running jobs end now, as "service closed"
            spawned.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.pch_builds.close()
        if self.own_zygote:
            self.zygote.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def default_pch_variants(self) -> list[tuple[str, tuple[str, ...]]]:
        """The precompiled-header variants built at start-up (pch_builds.py)."""
        return default_variants(self.backend)

    def request_pch(self, prelude: str, profile: tuple[str, ...], force: bool = False) -> None:
        """Queue a precompiled-header variant for background building (once per service).
        With pch='use' only `force=True` (benchmarks, tests) builds."""
        self.pch_builds.request(prelude, profile, force)

    def wait_pch(self, timeout_s: float | None = None) -> bool:
        """Block until every queued PCH variant is built (benchmarks use this); True when idle."""
        return self.pch_builds.wait(timeout_s)

    def _guarded_job(self, source: str) -> BuildResult:
        try:
            return self._job(source)
        except Exception as e:  # the future must always carry a BuildResult
            log.exception("build job failed")
            return infra_result(f"build service error: {type(e).__name__}: {e}", self.toolchain_id)

    def _job(self, source: str) -> BuildResult:
        t0 = time.monotonic()
        source_key = hashlib.sha256(
            f"{self.toolchain_id}\n{self.prelude_policy}\n{symbols.RULES_VERSION}\n{source}".encode()
        ).hexdigest()[:32]
        cached = self._cached_capture(source_key, t0)
        if cached is not None:
            return cached
        job = _Job(uuid.uuid4().hex[:16], self.jobs_dir, self.cache)
        job_dir = job.dir
        try:
            (job_dir / "work" / CANDIDATE_FILE).write_text(source)
            events, outcome = self._capture(job)
            result, pch_wanted = assemble(events, outcome, self.toolchain_id, self.timeout_s, job_dir / "stderr.txt")
            result.pins = job.pins  # the run that follows holds them until its sandbox has its own links
            result.seconds = time.monotonic() - t0
            result.phases["fork"] = outcome.get("fork_s", 0.0)
            result.capture_exit = outcome.get("exit") or {}
            result.sandbox = outcome.get("jail") or {}
            for prelude, profile in pch_wanted:
                if isinstance(prelude, str) and isinstance(profile, list):
                    self.request_pch(prelude, tuple(str(f) for f in profile))
            if result.ok or result.error_class == "compile":
                self.cache.store_capture(source_key, result.to_dict())
            return result
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)
            self.cache.trim(self.cache_bytes)

    def _cached_capture(self, source_key: str, t0: float) -> BuildResult | None:
        data = self.cache.load_capture(source_key)
        if data is None:
            return None
        try:
            result = BuildResult.from_dict(data)
        except (KeyError, TypeError, ValueError):
            return None
        result.pins = self.cache.pin(result.artifacts)
        if not all(self.cache.lookup(key) is not None for key in result.artifacts):
            result.pins.release()
            return None  # an artifact was evicted: capture again
        result.cached = True
        result.seconds = time.monotonic() - t0
        result.phases = {"cache": result.seconds}
        return result

    def _hidden(self) -> tuple[str, ...]:
        return (str(self.cache_dir), str(self.pch.root.parent))

    def _capture(self, job: _Job) -> tuple[list[dict], dict]:
        """Run the capture process of one job and serve its build requests. Returns (events, outcome)."""
        job_dir = job.dir
        spec = isolation.run_jail(
            str(job_dir / "work"),
            cuda=self.gpu_visible,
            uid=self.zygote.next_uid(),
            hidden=self._hidden(),
            nproc=self.max_processes,
            libs=str(job.libs),
        )
        job.spec = spec
        if not self.gpu_visible:  # the compile stage must never touch a GPU (a timing window may be open on it)
            spec = _with_env(spec, CUDA_VISIBLE_DEVICES="")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ev_r, ev_w = os.pipe()
        t_fork = time.monotonic()
        try:
            spawned = self.zygote.spawn(
                "capture",
                spec,
                [theirs.fileno(), ev_w],
                str(job_dir / "stderr.txt"),
                {"memory_limit_bytes": self.memory_limit, "device": self.device},
            )
        except ZygoteError as err:
            ours.close()
            os.close(ev_r)
            return [], {"infra": f"the compile zygote could not start a capture process: {err}"}
        finally:
            theirs.close()
            os.close(ev_w)
        self._active[job.name] = spawned
        fork_s = time.monotonic() - t_fork
        deadline = time.monotonic() + self.timeout_s
        watch = TreeWatch(
            spawned.sandbox or spawned.pid, deadline, self.max_processes, self.memory_limit, lambda: self._kill(spawned)
        )
        events: list[dict] = []
        jail: dict = {}
        try:
            jail = self._converse(ours, job, deadline, events)
        finally:
            watch.stop()
            self._kill(spawned)
            ours.close()
            evidence = read_evidence(ev_r)
            try:
                status = self.zygote.reap(spawned.pid)
            except ZygoteError as err:
                return events, {"infra": f"the compile zygote died: {err}"}
            finally:
                self._active.pop(job.name, None)
                spawned.close()
        if (
            self._closed
            and watch.verdict is None
            and status.signal == 9
            and not any(e["event"] == "done" for e in events)
        ):
            return events, {"infra": "the build service was closed while this candidate was building"}
        st = {"signal": status.signal} if status.signal else {"exit": status.code}
        return events, {
            "status": st,
            "killed": watch.verdict,
            "fork_s": fork_s,
            "exit": status.to_json(),
            "jail": jail,
            "limits": {"memory_bytes": self.memory_limit, "processes": self.max_processes},
            "evidence": evidence,
        }

    def _converse(self, ours: socket.socket, job: _Job, deadline: float, events: list[dict]) -> dict:
        """Read a capture process's messages until it ends: serve its build requests, keep its
        events (never its claims to be trusted; bounded: the module docstring); returns the jail
        report it sent first, before any candidate code existed."""
        jail: dict = {}
        received = total = 0
        while True:
            try:
                msg, size = wire.recv_counted(ours, deadline + 1.0, max_bytes=MAX_EVENT_BYTES)
            except (wire.PeerClosed, wire.PeerTimeout, wire.WireError, OSError):
                break
            received, total = received + 1, total + size
            if received > MAX_CAPTURE_EVENTS or total > MAX_CAPTURE_BYTES:
                events.append(
                    {
                        "event": "flood",
                        "trusted": True,
                        "message": f"module-level code sent the build service more than {MAX_CAPTURE_EVENTS} "
                        f"messages or {MAX_CAPTURE_BYTES >> 20} MB and was stopped",
                    }
                )
                break
            if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
                continue
            kind = msg["event"]
            if kind == "start" and received == 1:
                jail = msg.get("jail") if isinstance(msg.get("jail"), dict) else {}
                job.jail = jail
            elif kind == "build":
                reply = self._serve_build(msg.get("spec"), job, deadline, events)
                try:
                    wire.send(ours, reply)
                except OSError:
                    break
            elif kind in KEPT_EVENTS and kind not in job.kept:
                job.kept.add(kind)
                events.append(_kept(kind, msg))
        return jail

    def _kill(self, spawned) -> None:
        spawned.kill()

    # ------------------------------------------------------------------------------ builds
    def _serve_build(self, raw_spec, job: _Job, deadline: float, events: list[dict]) -> dict:
        """Answer one build request of a capture process; records trusted events about it."""
        job.builds += 1
        if job.builds > MAX_BUILDS:
            return job.refuse(events, f"more than {MAX_BUILDS} load_inline calls in one candidate")
        try:
            spec = ExtensionSpec.from_dict(raw_spec)
            check_flags(spec)
        except UnsupportedCall as e:
            return job.refuse(events, str(e))
        except (ValueError, TypeError) as e:
            return job.refuse(events, f"malformed load_inline call: {e}", "malformed load_inline call")
        key = spec.key(self.toolchain_id)
        first = key not in job.keys
        if first:
            job.source_bytes += _spec_bytes(spec)
            if job.source_bytes > MAX_SOURCE_BYTES:
                return job.refuse(
                    events, f"load_inline sources larger than {MAX_SOURCE_BYTES >> 20} MB in one candidate"
                )
            job.keys.add(key)
            job.pins.add(self.cache.pin([key]))
            events.append({"event": "spec", "spec": spec.to_dict()})
        built = self.extensions.build(spec, job.dir, deadline)
        if first:
            events.append(built)
        if built["event"] == "built":
            return {"ok": True, "so": job.link(key, Path(built["so"]))}
        if built["event"] == "rejected":
            return {"ok": False, "message": "the built library imports what a kernel may not (see the verdict)"}
        return {"ok": False, "message": "compile error"}


class _Job:
    """One capture job: its directory (scratch `work/`, its own library directory `lib/`), what it
    asked to build so far, what of its events is kept, and the cache entries it holds in use."""

    def __init__(self, name: str, jobs_dir: Path, cache: ArtifactCache) -> None:
        self.name = name
        self.dir = jobs_dir / name
        (self.dir / "work").mkdir(parents=True)
        self.libs = self.dir / "lib"
        self.libs.mkdir(mode=0o755)
        os.chmod(self.libs, 0o755)
        self.cache = cache
        self.spec = None  # its JailSpec, once forked
        self.jail: dict = {}  # its jail report (the capture's first message)
        self.builds = 0
        self.source_bytes = 0
        self.keys: set[str] = set()
        self.kept: set[str] = set()
        self.pins = Pins()

    def link(self, key: str, so: Path) -> str:
        """Put a verified library into this job's own directory (a hard link: the cache may evict its
        entry meanwhile); the path the capture process sees it at."""
        d = self.libs / key
        d.mkdir(mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
        target = d / so.name
        if not target.exists():
            try:
                os.link(so, target)
            except OSError:
                shutil.copyfile(so, target)
                os.chmod(target, 0o644)
        inside = self.spec.seen_at(str(self.libs), self.jail) if self.spec is not None else str(self.libs)
        return f"{inside}/{key}/{so.name}"

    def refuse(self, events: list[dict], message: str, reply: str = "") -> dict:
        """A build request the service does not serve: said once in the events (the first reason is the
        verdict's), answered with a short reply."""
        message = message[:MAX_TEXT]
        if "unsupported" not in self.kept:
            self.kept.add("unsupported")
            events.append({"event": "unsupported", "message": message})
        return {"ok": False, "message": (reply or message)[:MAX_TEXT]}


def _kept(kind: str, msg: dict) -> dict:
    """The fields of a capture process's event that are kept, strings cut to MAX_TEXT."""
    out: dict = {"event": kind}
    for name in KEPT_EVENTS[kind]:
        value = msg.get(name)
        if isinstance(value, str):
            out[name] = value[:MAX_TEXT]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _spec_bytes(spec: ExtensionSpec) -> int:
    parts = [*spec.cpp_sources, *spec.cuda_sources, *spec.extra_cflags, *spec.extra_cuda_cflags, *spec.extra_ldflags]
    return sum(len(p) for p in parts) + sum(len(f) for f in spec.functions)


def _with_env(spec, **extra):
    from dataclasses import replace

    env = dict(spec.env)
    env.update(extra)
    return replace(spec, env=tuple(sorted(env.items())))
