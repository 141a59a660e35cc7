"""BuildService: capture and compile candidates, every step of it jailed, the cache written only here.

submit(source) -> Future[BuildResult]. Each job: look the whole source up in the capture cache;
else write it to a scratch dir and fork a *capture* process from the zygote (jailed like any process
that runs candidate code), watched from a service thread (wall-clock deadline, process count,
resident memory of its whole tree). The capture process asks for each `load_inline` call to be
built; the service answers from the artifact cache, or forks a jailed *build* process that runs the
compilers in its own directory, reads what the built library imports (symbols.py: ATen compute,
dispatcher bypasses, run-time symbol lookup are findings), publishes it into the cache when it has
no finding (a library with one is never kept where anything could load it: only its findings are),
links it into the job's own library directory and answers with its path there: the capture process
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
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Self

from actors.verifier import isolation, wire
from actors.verifier.zygote import Zygote, ZygoteError

from . import diagnostics, symbols
from .cache import DEFAULT_MAX_BYTES, ArtifactCache, Pins
from .capture import CANDIDATE_FILE
from .pch_builds import PchBuilds, default_pch_dir, default_variants
from .preludes import FENCE, NATIVE, PchStore
from .results import BuildResult, assemble, infra_result
from .spec import ExtensionSpec, UnsupportedCall, check_flags, spec_from_call
from .toolchain import Toolchain
from .watch import TreeWatch, log_tail, read_evidence

log = logging.getLogger(__name__)

MAX_EVENT_BYTES = 8 << 20  # one message of a capture process (a load_inline call carries its sources)
MAX_CAPTURE_EVENTS = 10_000  # a capture process that sends more is killed
MAX_CAPTURE_BYTES = 64 << 20  # all messages of one capture process: one that sends more is killed
MAX_BUILDS = 32  # load_inline calls of one candidate
MAX_SOURCE_BYTES = 8 << 20  # the sources and flags of its distinct load_inline calls, together
MAX_TEXT = 2000  # characters kept of any text a capture process sent (an exception's message, ...)
MAX_LIBRARY_BYTES = 256 << 20  # a built library larger than this is refused (a compile error)
# The candidate's events that are kept (the first of each kind; the rest carry nothing new), and the
# fields of each: nothing else a capture process sent survives its conversation.
KEPT_EVENTS = {
    "exception": ("type", "message", "traceback"),
    "unsupported": ("message",),
    "import_error": ("name", "message"),
    "done": ("seconds", "compile_seconds"),
}
# The known-good extension that tells a failing machine from a failing candidate (`_confirm_infra`).
CANARY_SOURCE = "torch::Tensor kiln_canary(torch::Tensor x) { return x; }"


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
        self.allowlist = symbols.Allowlist.from_torch()
        # torch's exports, for the symbol check of the first builds: read now, beside the zygote's start
        threading.Thread(target=self.allowlist.torch.load, name="kiln-torch-exports", daemon=True).start()
        self._closed = False
        self._active: dict = {}  # job -> its running capture process (zygote.Spawned), for close()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-build")
        self._key_locks: dict[str, threading.Lock] = {}
        self._key_guard = threading.Lock()
        self.own_zygote = zygote is None
        self.zygote = zygote or Zygote(start_timeout_s)
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

    # ------------------------------------------------------------------------------ jobs
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
        built = self.build(spec, job.dir, deadline)
        if first:
            events.append(built)
        if built["event"] == "built":
            return {"ok": True, "so": job.link(key, Path(built["so"]))}
        if built["event"] == "rejected":
            return {"ok": False, "message": "the built library imports what a kernel may not (see the verdict)"}
        return {"ok": False, "message": "compile error"}

    def build(self, spec: ExtensionSpec, job_dir: Path, deadline: float) -> dict:
        """One extension: from the cache, or compiled in a jailed build process, symbol-checked and
        published. Returns the trusted event: {"event": "built", ...} or {"event": "compile_error", ...}."""
        key = spec.key(self.toolchain_id)
        t0 = time.monotonic()
        hit = self._hit(key, spec, t0)
        if hit:
            return hit
        with self._key_lock(key), self.cache.lock(key):
            hit = self._hit(key, spec, t0)
            if hit:
                return hit
            bdir = job_dir / f"build-{key[:12]}"
            bdir.mkdir(parents=True, exist_ok=True)
            reply, exit_status = self._run_builder(spec, bdir, deadline)
            if not reply.get("ok") and reply.get("infra") is True:
                reply = self._confirm_infra(reply, job_dir, deadline)
            if not reply.get("ok"):
                message = diagnostics.sanitize(str(reply.get("message") or "the build failed")[: 4 * MAX_TEXT])
                return {
                    "event": "compile_error",
                    "trusted": True,
                    "key": key,
                    "name": spec.name,
                    "infra": reply.get("infra") is True,
                    "unit": str(reply.get("unit", ""))[:40],
                    "message": message[:MAX_TEXT],
                    "phases": _phases(reply.get("phases")),
                    "exit": exit_status,
                }
            out = bdir / "work"
            so = out / Path(str(reply["so"])).name
            too_large = _too_large(so)
            if too_large:
                return {
                    "event": "compile_error",
                    "trusted": True,
                    "key": key,
                    "name": spec.name,
                    "infra": False,
                    "unit": "link",
                    "message": too_large,
                    "phases": {},
                    "exit": exit_status,
                }
            check = symbols.check_library(str(so), self.allowlist, self._library_dirs())
            vendors = sorted(set(reply.get("vendor_libs") or []) | check.vendors)[:20]
            meta = {
                "prelude": str(reply.get("prelude", ""))[:100],
                "vendor_libs": vendors,
                "notes": [str(n)[:MAX_TEXT] for n in (reply.get("notes") or [])[:20]],
                "phases": _phases(reply.get("phases")),
                "symbols": check.to_json(),
            }
            if check.violations:  # never published: only what it imports is remembered
                self.cache.reject(key, meta)
                return _rejected(key, meta, cached=False)
            final = self.cache.publish(key, out, so.name, meta)
            binding = reply.get("binding")
            if isinstance(binding, list) and len(binding) == 2 and (out / str(binding[1])).is_file():
                self.cache.publish_binding(str(binding[0]), out / str(binding[1]))
            return {
                "event": "built",
                "trusted": True,
                "key": key,
                "so": str(final),
                "prelude": meta["prelude"],
                "phases": meta["phases"],
                "vendor_libs": vendors,
                "cached": False,
                "notes": meta["notes"],
                "pch_wanted": (reply.get("pch_wanted") or [])[:16],
                "violations": [],
            }

    def _hit(self, key: str, spec: ExtensionSpec, t0: float) -> dict | None:
        found = self.cache.lookup(key)
        if not found:
            record = self.cache.rejected(key)
            return _rejected(key, record, cached=True) if record is not None else None
        so, meta = found
        sym = meta.get("symbols") if isinstance(meta.get("symbols"), dict) else {}
        if sym.get("violations"):  # an entry a service before this rule kept: never handed out
            return _rejected(key, meta, cached=True)
        return {
            "event": "built",
            "trusted": True,
            "key": key,
            "so": str(so),
            "prelude": str(meta.get("prelude", "cache")),
            "phases": {"cache": time.monotonic() - t0},
            "vendor_libs": list(meta.get("vendor_libs", [])),
            "cached": True,
            "notes": [],
            "pch_wanted": [],
            "violations": [],
        }

    def _key_lock(self, key: str) -> threading.Lock:
        with self._key_guard:
            return self._key_locks.setdefault(key, threading.Lock())

    def _library_dirs(self) -> tuple[str, ...]:
        dirs = [self.toolchain.torch_libdir, self.toolchain.cuda_libdir]
        return tuple(os.path.realpath(d).rstrip("/") for d in dirs if d) + tuple(d.rstrip("/") for d in dirs if d)

    def _toolchain_paths(self) -> tuple[str, ...]:
        tc = self.toolchain
        paths = [
            self.pch.root,
            self.cache.root / "bind",
            tc.torch_libdir,
            tc.python_include,
            *tc.torch_includes,
            os.path.dirname(os.path.realpath(tc.cxx)),
        ]
        if tc.nvcc:
            paths += [tc.cuda_home, tc.cuda_libdir, os.path.dirname(os.path.realpath(tc.nvcc))]
        return tuple(str(p) for p in paths if p)

    def _confirm_infra(self, reply: dict, job_dir: Path, deadline: float) -> dict:
        """A build that failed as if the machine failed (a compiler killed by a signal, a build process
        that never answered) is the machine's only if a known-good extension fails too, built now the
        same way; otherwise the failure is the candidate's (a source that crashes or starves the
        compiler is a compile error). Never decided from text the compiler printed."""
        canary = spec_from_call("kiln_canary", CANARY_SOURCE, functions=["kiln_canary"])
        cdir = job_dir / f"canary-{uuid.uuid4().hex[:8]}"
        cdir.mkdir(parents=True, exist_ok=True)
        try:
            check, _ = self._run_builder(canary, cdir, max(deadline, time.monotonic() + 60.0))
        finally:
            shutil.rmtree(cdir, ignore_errors=True)
        if not check.get("ok"):
            return dict(
                reply,
                message=f"{reply.get('message', '')}\n(a known-good extension failed to build as "
                "well: the machine, not the candidate)",
            )
        return dict(
            reply,
            infra=False,
            message=f"{reply.get('message', '')}\n(the compiler failed on this source; "
            "a known-good extension built right after)",
        )

    def _run_builder(self, spec: ExtensionSpec, bdir: Path, deadline: float) -> tuple[dict, dict]:
        jail = isolation.build_jail(
            str(bdir / "work"),
            uid=self.zygote.next_uid(),
            toolchain_paths=self._toolchain_paths(),
            hidden=self._hidden(),
        )
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            spawned = self.zygote.spawn("build", jail, [theirs.fileno()], str(bdir / "build.log"))
        except ZygoteError as err:
            ours.close()
            return {"ok": False, "infra": True, "unit": "builder", "message": f"no build process: {err}"}, {}
        finally:
            theirs.close()
        watch = TreeWatch(
            spawned.sandbox or spawned.pid,
            deadline,
            4 * self.max_processes,
            4 * self.memory_limit,
            lambda: self._kill(spawned),
        )
        try:
            wire.send(
                ours,
                {
                    "spec": spec.to_dict(),
                    "toolchain": self.toolchain.to_dict(),
                    "pch_dir": str(self.pch.root.parent),
                    "cache_dir": str(self.cache_dir),
                    "prelude_policy": self.prelude_policy,
                },
            )
            reply = wire.recv(ours, deadline + 1.0, max_bytes=1 << 20)
            if not isinstance(reply, dict):
                reply = {"ok": False, "infra": True, "unit": "builder", "message": "the build process answered nothing"}
        except (wire.WireError, OSError) as err:
            verdict = watch.verdict
            if verdict == "timeout":
                reply = {
                    "ok": False,
                    "unit": "compiler",
                    "timeout": True,
                    "message": f"compiling did not finish within the {self.timeout_s:.0f} s limit",
                }
            elif verdict:
                reply = {
                    "ok": False,
                    "unit": "compiler",
                    "message": f"the compiler exceeded the compile stage's {verdict} limit",
                }
            else:
                tail = diagnostics.sanitize(log_tail(bdir / "build.log"))
                reply = {
                    "ok": False,
                    "infra": True,
                    "unit": "builder",
                    "message": f"the build process ended without an answer ({err}){tail}",
                }
        finally:
            watch.stop()
            self._kill(spawned)
            ours.close()
            try:
                status = self.zygote.reap(spawned.pid).to_json()
            except ZygoteError:
                status = {}
            spawned.close()
        return reply, status


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


def _rejected(key: str, meta: dict, *, cached: bool) -> dict:
    """The trusted event of a library that failed the symbol check (there is no library to use)."""
    sym = meta.get("symbols") if isinstance(meta.get("symbols"), dict) else {}
    return {
        "event": "rejected",
        "trusted": True,
        "key": key,
        "prelude": str(meta.get("prelude", ""))[:100],
        "phases": _phases(meta.get("phases")),
        "vendor_libs": [str(v)[:100] for v in (meta.get("vendor_libs") or [])[:20]],
        "cached": cached,
        "notes": [str(n)[:MAX_TEXT] for n in (meta.get("notes") or [])[:20]] if not cached else [],
        "violations": list(sym.get("violations") or [])[:50],
    }


def _phases(value) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:40]: float(v) for k, v in list(value.items())[:32] if isinstance(v, (int, float))}


def _spec_bytes(spec: ExtensionSpec) -> int:
    parts = [*spec.cpp_sources, *spec.cuda_sources, *spec.extra_cflags, *spec.extra_cuda_cflags, *spec.extra_ldflags]
    return sum(len(p) for p in parts) + sum(len(f) for f in spec.functions)


def _too_large(so: Path) -> str:
    try:
        size = so.stat().st_size
    except OSError:
        return "the build produced no library"
    if size > MAX_LIBRARY_BYTES:
        return f"the built library is {size >> 20} MB; the verifier takes libraries of at most {MAX_LIBRARY_BYTES >> 20} MB"
    return ""


def _with_env(spec, **extra):
    from dataclasses import replace

    env = dict(spec.env)
    env.update(extra)
    return replace(spec, env=tuple(sorted(env.items())))
