"""Extension builds: one `load_inline` call (an ExtensionSpec) made into a library the sandbox may load.

`ExtensionBuilds.build(spec, job_dir, deadline)` answers from the artifact cache, or compiles the
spec in a jailed *build* process (forked from the zygote, its tree watched for time, processes and
memory), reads what the built library imports (symbols.py: ATen compute, dispatcher bypasses,
run-time symbol lookup are findings) and publishes it into the cache only when it has no finding (a
library with one is never kept where anything could load it: only its findings are). A build that
failed as if the machine failed is the machine's only if a known-good extension fails too
(`_confirm_infra`). The answer is a trusted event: built, rejected or compile_error. The capture
conversation that asks for builds is service.py's.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

from actors.verifier import isolation, wire
from actors.verifier.zygote import Zygote, ZygoteError

from . import diagnostics, symbols
from .cache import ArtifactCache
from .preludes import PchStore
from .spec import ExtensionSpec, spec_from_call
from .toolchain import Toolchain
from .watch import TreeWatch, log_tail

MAX_TEXT = 2000  # characters kept of any text a build or a capture process sent (an exception's message, ...)
MAX_LIBRARY_BYTES = 256 << 20  # a built library larger than this is refused (a compile error)
# The known-good extension that tells a failing machine from a failing candidate (`_confirm_infra`).
CANARY_SOURCE = "torch::Tensor kiln_canary(torch::Tensor x) { return x; }"


class ExtensionBuilds:
    """The builds of one build service: thread-safe (one build of a key at a time, across threads
    and, through the cache's lock, across processes)."""

    def __init__(
        self,
        toolchain: Toolchain,
        cache: ArtifactCache,
        cache_dir: Path,
        pch: PchStore,
        zygote: Zygote,
        *,
        timeout_s: float,
        max_processes: int,
        memory_limit: int,
        prelude_policy: str,
        hidden: tuple[str, ...],
    ) -> None:
        self.toolchain, self.toolchain_id = toolchain, toolchain.id
        self.cache, self.cache_dir, self.pch, self.zygote = cache, Path(cache_dir), pch, zygote
        self.timeout_s = timeout_s
        self.max_processes, self.memory_limit = max_processes, memory_limit  # a build's tree gets 4x each
        self.prelude_policy = prelude_policy
        self.hidden = hidden  # paths no build process sees (the cache, the precompiled headers' store)
        self.allowlist = symbols.Allowlist.from_torch()
        # torch's exports, for the symbol check of the first builds: read now, beside the zygote's start
        threading.Thread(target=self.allowlist.torch.load, name="kiln-torch-exports", daemon=True).start()
        self._key_locks: dict[str, threading.Lock] = {}
        self._key_guard = threading.Lock()

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
            hidden=self.hidden,
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
            lambda: spawned.kill(),
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
            spawned.kill()
            ours.close()
            try:
                status = self.zygote.reap(spawned.pid).to_json()
            except ZygoteError:
                status = {}
            spawned.close()
        return reply, status


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


def _too_large(so: Path) -> str:
    try:
        size = so.stat().st_size
    except OSError:
        return "the build produced no library"
    if size > MAX_LIBRARY_BYTES:
        return f"the built library is {size >> 20} MB; the verifier takes libraries of at most {MAX_LIBRARY_BYTES >> 20} MB"
    return ""
