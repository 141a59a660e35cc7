"""Parent side of sandboxed execution: a bounded pool of jailed children with watchdogs.

`SandboxPool.session(arena_bytes, memory_limit_bytes)` forks a fresh sandbox from the zygote (one per candidate), jailed
as isolation.run_jail says (its scratch at jail.WORKDIR; its own built libraries, linked into a
directory of its own when it is prepared, at jail.LIBDIR: it sees no other candidate's), with three descriptors: its socket, the write end of its evidence pipe,
and its I/O arena (a memory file this process created and maps too: inputs go in, outputs come out,
nothing tensor-sized crosses the socket; on cuda both sides page-lock it, so copies to and from the
device go by DMA). It watches the resident memory of the sandbox's process
tree (RssWatchdog; RLIMIT_AS would break CUDA contexts) and gives every request a wall-clock
deadline. The first request, `hello`, is answered before any candidate code exists: its jail report
is the one the verdict trusts.

What this process takes from a sandbox, and how each read is bounded:
* replies: a 4-byte length, at most MAX_REPLY bytes of msgpack, and a MAC under the session's key
  (sandbox.py); the length is checked before anything is allocated, a reply without the right MAC
  or nonce is forged (the candidate can write to the socket, not compute the MAC);
* evidence: kiln_native's numbered log of what the compute fence and the audit hook refused, the
  moment they refused: carried by every signed reply, and written to the evidence pipe too (read
  here without blocking, for a process that dies before replying); at most MAX_EVIDENCE records,
  each counted once. A pipe the candidate closed or replaced is itself a record of the log;
* outputs: bytes in the arena, at offsets this process chose, of the sizes it expects;
* its own observations: the exit status, the memory watchdog, the shared mappings of the sandbox's
  address space (read from /proc here, not from the sandbox).
A sandbox that hangs is killed (and with it its whole PID namespace); one that crashes, exits, or is
killed for memory is reaped and its own exit status recorded. Only that sandbox is lost: the next
session forks a new one, and the zygote (which never runs candidate code) keeps serving.
"""

from __future__ import annotations

import fcntl
import hmac
import os
import secrets
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import msgpack

from actors.verifier import isolation, limits, native
from actors.verifier.arena import Arena
from actors.verifier.attribution import AddressMap
from actors.verifier.isolation import RssWatchdog
from actors.verifier.legality import Violation
from actors.verifier.provenance import CpuProvenance, CudaProvenance, Traced, Window, judge_cpu, judge_cuda
from actors.verifier.sampling import CpuSampler
from actors.verifier.zygote import ExitStatus, Zygote, ZygoteError

MAX_REPLY = 1 << 20  # a reply is metadata: output descriptors, an error text, timings
MAX_EVIDENCE = 200
# cuda: the requests traced by default (a `trip` says whether it is: audit trips are, timed trips are
# not), and the bounds on what is kept of their records. Each trace costs CUPTI's records switched on,
# flushed and off (about 0.7 ms on an H200, device_trace.py), so only the candidate's calls are
# traced, not the sandbox's staging and fetches.
TRACED_OPS = frozenset({"call"})
MAX_TRACED = 4096
MAX_TRACED_NAMES = 64
MAC_BYTES = 32
# A sandbox that ends (not by the verifier's own kill) with its resident memory past this share of its
# limit at the watchdog's last look died of memory: the kernel acts between two looks.
NEAR_LIMIT = 0.9
_HEADER = struct.Struct("<I")
_SIGNAL_HINTS = {
    signal.SIGSEGV: "a segmentation fault (out-of-bounds pointer or index?)",
    signal.SIGBUS: "a bus error (misaligned or out-of-bounds access)",
    signal.SIGFPE: "a floating-point exception (integer division by zero?)",
    signal.SIGILL: "an illegal instruction",
    signal.SIGABRT: "an abort (a failed assertion or an uncaught C++ exception)",
    signal.SIGKILL: "SIGKILL (the system's out-of-memory killer?)",
    signal.SIGSYS: "SIGSYS (a forbidden system call)",
}


class SandboxFailure(Exception):
    """The child could not answer a request."""

    error_class = "runtime"


class SandboxTimeout(SandboxFailure):
    error_class = "timeout"


class SandboxCrash(SandboxFailure):
    error_class = "runtime"

    def __init__(
        self, message: str, status: ExitStatus, exited_cleanly: bool, memory: bool = False, capped: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.exited_cleanly = exited_cleanly  # exit status 0 mid-request, not of memory: os._exit / a forged finish
        self.memory = memory  # died of memory: the watchdog's kill, or the kernel's out-of-memory killer
        if memory and capped:  # the machine gives less than any candidate needs (limits.py, `starved`): not its doing
            self.error_class = "infra"


class SandboxForged(SandboxFailure):
    """The channel carried a message the sandbox's own code did not send."""

    error_class = "cheating"


class SandboxInfra(SandboxFailure):
    """The sandbox could not be started, or failed before any candidate code existed (the system's fault)."""

    error_class = "infra"


class ChildSession:
    """One jailed sandbox serving one candidate."""

    def __init__(
        self,
        pool: SandboxPool,
        memory_limit_bytes: int,
        arena_bytes: int = 1 << 16,
        check_cuda: bool = False,
        memory_capped: bool = False,
    ) -> None:
        self.pool = pool
        self.memory_capped = memory_capped  # the limit is the machine's, below what any candidate needs
        self.oom_kills = limits.oom_kills()  # the kernel's count before this sandbox existed
        self.killed = False  # the verifier sent the SIGKILL (watchdog, deadline), not the kernel
        self.scratch = Path(tempfile.mkdtemp(prefix="kiln-sandbox-", dir=pool.scratch_root))
        self.work = self.scratch / "work"
        self.work.mkdir()
        os.chmod(self.work, 0o755)
        self.libs = self.scratch / "lib"  # this candidate's own built libraries, and nothing else
        self.libs.mkdir()
        os.chmod(self.libs, 0o755)
        self.alive = False
        self.status: ExitStatus | None = None
        self.requests = 0
        self.waited_s = 0.0
        self.evidence: list[Violation] = []
        self.jail: dict = {}
        self.cuda_error: str | None = None
        self.gpus_seen: list | None = None  # the probe's answer on cuda: the UUIDs of the GPUs it sees
        self.key = secrets.token_bytes(32)
        self.arena = Arena(arena_bytes)
        if pool.device_type == "cuda":
            self.arena.pin()  # on its own thread, while the sandbox starts
        self.baseline_maps: set[str] = set()
        # Provenance evidence (cpu): where the sandbox's threads ran, sampled by this process, and the
        # windows of the requests this process timed (provenance.py judges them).
        self.sampler: CpuSampler | None = None
        self.addresses: AddressMap | None = None
        self.windows: list[Window] = []
        self.own_files: list[str] = []  # the candidate's built libraries, as linked for this sandbox
        # cuda: the device's record of the kernels each traced request ran (sealed._tracing).
        self.traced: list[Traced] = []
        self.traces = pool.device_type == "cuda"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ev_r, ev_w = os.pipe()
        fcntl.fcntl(ev_r, fcntl.F_SETFL, os.O_NONBLOCK)
        self._evidence_fd = ev_r
        self._evidence_buf = b""
        self._evidence_seen: set[int] = set()
        spec = isolation.run_jail(
            str(self.work),
            cuda=pool.device_type == "cuda",
            uid=pool.zygote.next_uid(),
            hidden=pool.hidden,
            visible=pool.visible,
            gpu=pool.gpu,
            libs=str(self.libs),
        )
        self.spec = spec
        try:
            spawned = pool.zygote.spawn(
                "run",
                spec,
                [theirs.fileno(), ev_w, self.arena.fd],
                str(self.scratch / "output.log"),
                {"device": pool.device_type},
            )
        except ZygoteError as err:
            ours.close()
            os.close(ev_r)
            self.arena.close()
            raise SandboxInfra(str(err)) from None
        finally:
            theirs.close()
            os.close(ev_w)
        self.spawned = spawned
        self.pid = spawned.pid
        self.sandbox_pid = spawned.sandbox or spawned.pid
        self.sock = ours
        self.alive = True
        self.watchdog = RssWatchdog(self.sandbox_pid, memory_limit_bytes + self.arena.size, self.kill)
        if pool.device_type == "cpu":  # before any candidate code exists: every thread it starts is sampled
            self.sampler = CpuSampler(self.sandbox_pid)
        try:
            hello = self.request("hello", {"check_cuda": check_cuda}, 120, signed=False)
            self.jail = hello.get("jail") if isinstance(hello.get("jail"), dict) else {}
            self.cuda_error = hello.get("cuda") if isinstance(hello.get("cuda"), str) else None
            self.gpus_seen = hello.get("gpus") if isinstance(hello.get("gpus"), list) else None
        except SandboxFailure as err:
            tail = self.output_tail()
            self.close()
            raise SandboxInfra(f"the sandbox did not start: {err}" + (f"\n{tail}" if tail else "")) from None
        self.baseline_maps = self.shared_mappings()

    # ------------------------------------------------------------------------------ requests

    def prepare(
        self, source: str, digest: str, artifacts: dict | None, toolchain: str, threads: int, budget_s: float
    ) -> dict:
        """Write the candidate where the sandbox (read-only) sees it, link its own built libraries into
        its library directory, and have it sealed and imported. The paths it is given are the ones it
        sees them at (neutral: jail.WORKDIR, jail.LIBDIR)."""
        name = f"kiln_candidate_{digest[:16]}.py"
        path = self.work / name
        path.write_text(source, encoding="utf-8")
        os.chmod(path, 0o644)
        table = self.own_libraries(artifacts) if artifacts is not None else None
        # Provenance: the files the sandbox loads its own code from (by inode: a link or the copy made here).
        self.addresses = AddressMap(self.own_files)
        reply = self.request(
            "prepare",
            {
                "candidate": f"{self.spec.inside(_report(self.jail))}/{name}",
                "source": source,
                "artifacts": table,
                "toolchain": toolchain,
                "key": self.key,
                "threads": threads,
                "arena": self.arena.size,
            },
            budget_s,
            signed=False,
        )
        self.baseline_maps = self.shared_mappings()  # sealed, the arena mapped, no candidate code yet
        return reply

    def own_libraries(self, artifacts: dict) -> dict:
        """The artifact table as the sandbox sees it: each built library linked (or copied, across
        filesystems) into this session's own directory, by its spec key; the paths are inside."""
        inside = self.spec.seen_at(str(self.libs), self.jail)
        table = {}
        self.own_files = []
        for key, host in artifacts.items():
            src = Path(host)
            key = Path(str(key)).name  # a spec key: one path component
            d = self.libs / key
            d.mkdir(exist_ok=True)
            os.chmod(d, 0o755)
            target = d / src.name
            if not target.exists():
                try:
                    os.link(src, target)
                except OSError:
                    shutil.copyfile(src, target)
                    os.chmod(target, 0o644)
            table[key] = f"{inside}/{key}/{src.name}"
            self.own_files.append(str(target))
        return table

    def request(self, op: str, body: dict, budget_s: float, *, signed: bool = True) -> dict:
        """Send one request and wait up to `budget_s` for its reply (raises SandboxFailure). Replies to
        the requests answered before any candidate code exists (`signed=False`: hello, prepare) carry no
        MAC and may say `internal` (the sandbox's own failure); every later one must carry the MAC."""
        if not self.alive:
            raise SandboxCrash("the sandbox child is gone", self.status or ExitStatus(None, None), False)
        nonce = secrets.token_hex(12)
        deadline = time.monotonic() + budget_s
        self.requests += 1
        if self.traces and op in TRACED_OPS and "trace" not in body:
            body = {**body, "trace": True}
        started_ns = time.monotonic_ns()
        try:
            payload = msgpack.packb({"op": op, "nonce": nonce, **body}, use_bin_type=True)
            self.sock.settimeout(max(budget_s, 0.001))
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)
            reply = self._reply(deadline, signed)
            if signed:
                self.take_logged(reply)
        except TimeoutError:
            self.kill()
            self._reap()
            raise SandboxTimeout(f"no answer within {budget_s:.0f} s") from None
        except (ConnectionError, BrokenPipeError, EOFError, OSError) as err:
            if isinstance(err, _Forged):
                self.kill()
                self._reap()
                raise SandboxForged(str(err)) from None
            raise self._crashed() from None
        finally:
            self.drain_evidence()
            kind = f"{op}:null" if op == "trip" and body.get("null") else op
            self.windows.append(Window(kind, started_ns, time.monotonic_ns()))
        if self.addresses is not None and op in ("load", "build"):  # libraries load at import and in __init__
            self.addresses.observe(self.sandbox_pid)
        kernels = reply.pop("kernels", None) if signed else None
        if type(kernels) is list and len(self.traced) < MAX_TRACED:
            calls = 1 if op == "call" else body.get("count", 0) if op == "trip" and not body.get("null") else 0
            lost = reply.pop("trace_lost", 0)
            lost = lost if type(lost) is int and lost >= 0 else 1  # a forged count is a lost record
            self.traced.append(Traced(kind, calls, kernels[:MAX_TRACED_NAMES], lost))
        if reply.get("internal") and not signed:
            return reply
        if reply.get("nonce") != nonce:
            self.kill()
            self._reap()
            raise SandboxForged("the sandbox channel carried a reply to a request the verifier did not send")
        return reply

    def _reply(self, deadline: float, signed: bool) -> dict:
        head = self._read(_HEADER.size, deadline)
        (n,) = _HEADER.unpack(head)
        if n > MAX_REPLY:
            raise _Forged(f"a reply announced {n} bytes; replies are at most {MAX_REPLY}")
        payload = self._read(n, deadline)
        try:
            reply = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception:  # noqa: BLE001 - anything undecodable is a message the sandbox's code did not send
            raise _Forged("the sandbox channel carried an undecodable reply") from None
        if not isinstance(reply, dict):
            raise _Forged("the sandbox channel carried a reply that is not a map")
        if signed:
            mac = self._read(MAC_BYTES, deadline)
            if not hmac.compare_digest(mac, hmac.digest(self.key, payload, "sha256")):
                raise _Forged("the sandbox channel carried a reply without the sandbox's MAC (a forged result?)")
        return reply

    def _read(self, n: int, deadline: float) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            self.sock.settimeout(left)
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("the sandbox closed its channel")
            got += k
        return bytes(buf)

    # ------------------------------------------------------------------------ observations

    def cuda_provenance(self, own: frozenset[str], unreadable: int, allow_vendor_libs: bool) -> CudaProvenance:
        """Whose kernels ran in the sandbox's traced requests (provenance.py), `own` being the names
        of the kernels the candidate's build defines."""
        return judge_cuda(self.traced, own, unreadable, allow_vendor_libs)

    def provenance(self, allow_vendor_libs: bool) -> CpuProvenance:
        """Whose code ran in the sandbox, and when (provenance.py), from this process's samples."""
        if self.addresses is not None and self.alive:
            self.addresses.observe(self.sandbox_pid)
        if self.sampler is None:
            return CpuProvenance(False, "not sampled on this backend")
        return judge_cpu(self.sampler, self.addresses or AddressMap([]), self.windows, allow_vendor_libs)

    def drain_evidence(self) -> None:
        """Read what the fence and the audit hook wrote to the evidence pipe (never blocks): the
        refusals of a process that dies before it can reply. The same log reaches the verifier in
        every signed reply (`take_logged`), so a pipe the candidate closed loses nothing."""
        while self._evidence_fd >= 0 and len(self._evidence_buf) < (1 << 20):
            try:
                chunk = os.read(self._evidence_fd, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._evidence_buf += chunk
        cut = self._evidence_buf.rfind(b"\n") + 1
        self._record(self._evidence_buf[:cut])
        self._evidence_buf = self._evidence_buf[cut:]

    def take_logged(self, reply: dict) -> None:
        """The refusals a signed reply carries (kiln_native's log since the previous reply)."""
        logged = reply.pop("evidence", b"")
        if isinstance(logged, bytes):
            self._record(logged)

    def _record(self, data: bytes) -> None:
        for seq, kind, what, where in native.evidence_records(data):
            if seq in self._evidence_seen or len(self.evidence) >= MAX_EVIDENCE:
                continue
            self._evidence_seen.add(seq)
            self.evidence.append(Violation(kind, what, where, "refused in the sandbox (recorded as it happened)"))

    def shared_mappings(self) -> set[str]:
        """The sandbox's shared memory mappings, read from /proc here (see `mapped_shared`)."""
        return mapped_shared(self.sandbox_pid, self.pool.device_type)

    def new_shared_mappings(self) -> list[str]:
        """Shared mappings that appeared since the sandbox started (before its candidate existed)."""
        if not self.alive:
            return []
        return sorted(self.shared_mappings() - self.baseline_maps)

    def _crashed(self) -> SandboxCrash:
        killed_here = self.killed
        self._reap()
        st = self.status or ExitStatus(None, None)
        memory = self.died_of_memory(st, killed_here)
        if memory:
            limit = self.watchdog.limit >> 20  # the I/O arena's pages included
            who = "the memory watchdog" if self.watchdog.tripped else "the kernel's out-of-memory killer"
            msg = f"the process exceeded the memory limit of {limit} MB and was killed by {who} (out of memory)"
            if self.memory_capped:
                msg += (
                    "; the limit is this machine's, below what any candidate needs for this task (the machine's fault)"
                )
        elif st.signal:
            hint = _SIGNAL_HINTS.get(st.signal, f"signal {st.signal}")
            msg = f"the process crashed with {hint}"
        elif st.code == 0:
            msg = "the process exited (status 0) in the middle of a request: os._exit/exit is not a way to finish"
        else:
            msg = f"the process exited with status {st.code}"
        tail = self.output_tail()
        if tail:
            msg += f"\nlast output:\n{tail}"
        return SandboxCrash(
            msg,
            st,
            exited_cleanly=(st.code == 0 and not st.signal and not memory),
            memory=memory,
            capped=self.memory_capped,
        )

    def died_of_memory(self, st: ExitStatus, killed_here: bool) -> bool:
        """Whether the sandbox's end was memory: the watchdog killed it, or it ended (a SIGKILL the
        verifier did not send, or any exit) while the kernel's out-of-memory killer acted or its
        resident memory was near the limit. A process that dies of memory is never called cheating,
        however its status reads (its warden, or the runtime, may report a plain exit)."""
        if self.watchdog.tripped:
            return True
        if killed_here:
            return False
        oom = limits.oom_kills() > self.oom_kills
        near = self.watchdog.peak >= NEAR_LIMIT * self.watchdog.limit
        return (oom or near) and (st.signal in (None, 0, signal.SIGKILL))

    def output_tail(self, limit: int = 1500) -> str:
        log = self.scratch / "output.log"
        try:
            with open(log, "rb") as f:
                f.seek(max(os.path.getsize(log) - limit, 0))
                return f.read(limit).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def kill(self) -> None:
        if self.alive:
            self.killed = True
            self.spawned.kill()

    def _reap(self) -> None:
        if not self.alive:
            return
        self.kill()
        try:
            self.status = self.pool.zygote.reap(self.pid)
        except Exception:  # noqa: BLE001 - the zygote went away: its children went with it (PDEATHSIG)
            self.status = ExitStatus(None, None)
        self.alive = False

    def close(self) -> None:
        """Ask the child to leave, make sure it is gone, and remove its scratch directory."""
        if self.alive:
            try:
                self.sock.settimeout(2.0)
                payload = msgpack.packb({"op": "close", "nonce": ""})
                self.sock.sendall(_HEADER.pack(len(payload)) + payload)
            except OSError:
                pass
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and _running(self.pid):
                time.sleep(0.005)
            self._reap()
        self.watchdog.stop()
        if self.sampler is not None:
            self.sampler.close()
        self.spawned.close()
        self.drain_evidence()
        self.sock.close()
        os.close(self._evidence_fd)
        self._evidence_fd = -1
        self.arena.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        shutil.rmtree(f"{self.work}.root", ignore_errors=True)

    def exit_status(self) -> dict:
        return (self.status or ExitStatus(None, None)).to_json()


def _report(jail: dict):
    """A sandbox's jail report (the dict its hello carried) as jail.JailReport."""
    from actors.verifier.jail import JailReport

    missing = jail.get("missing") if isinstance(jail.get("missing"), dict) else {}
    return JailReport(active=list(jail.get("active") or []), missing=dict(missing))


class _Forged(OSError):
    """A reply the sandbox's own code did not send (unbounded, undecodable, unsigned)."""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def mapped_shared(pid: int, device_type: str) -> set[str]:
    """A process's shared memory mappings (a file, shared memory or a memfd mapped MAP_SHARED), as
    "range name" lines of /proc/PID/maps. On cuda the driver maps devices, anonymous and memfd memory
    shared as the context grows, so only mappings of files count there (anything under /dev but
    /dev/shm is left out). Read by the verifier, not by the process itself."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 2 or parts[1][3:4] != "s":
                    continue
                name = parts[5].strip() if len(parts) > 5 else ""
                if device_type != "cpu" and not (
                    name.startswith("/") and (not name.startswith("/dev/") or name.startswith("/dev/shm/"))
                ):
                    continue
                found.add(f"{parts[0]} {name}")
    except OSError:
        pass
    return found


class SandboxPool:
    """At most `slots` sandboxes at a time (the run workers of one GPU), all forked from one zygote.

    `hidden` and `visible` extend the jail's view (the verifier's cache directory is hidden); a
    sandbox sees the libraries of its own build only (ChildSession.own_libraries). `gpu`
    (a CUDA_VISIBLE_DEVICES entry of this process's environment; "" = unpinned) is the one GPU its
    sandboxes see, as their device 0; `gpu_uuid` is that GPU's UUID, which the start-up probe's
    sandbox must report as the only one it sees."""

    def __init__(
        self,
        device_type: str,
        slots: int,
        memory_limit_mb: int,
        scratch_root: str | None = None,
        *,
        zygote: Zygote | None = None,
        hidden: tuple[str, ...] = (),
        visible: tuple[str, ...] = (),
        gpu: str = "",
        gpu_uuid: str = "",
    ) -> None:
        self.device_type = device_type
        self.gpu, self.gpu_uuid = gpu, gpu_uuid
        self.memory_limit_bytes = memory_limit_mb << 20
        self.scratch_root = scratch_root
        if scratch_root:
            Path(scratch_root).mkdir(parents=True, exist_ok=True)
        self.own_zygote = zygote is None
        self.zygote = zygote or Zygote()
        self.hidden, self.visible = tuple(hidden), tuple(visible)
        self._slots = threading.BoundedSemaphore(slots)
        self.children = 0

    def warm(self) -> None:
        """Start the zygote now rather than on the first request (it imports torch: seconds)."""
        self.zygote.start()

    def probe(self) -> dict:
        """The jail report of a sandbox on this machine (start-up check): which layers hold. On cuda,
        a sandbox must also be able to create a CUDA context; if it cannot, the verifier cannot work
        here at all, and says why (SandboxInfra)."""
        with self._slots:
            child = ChildSession(self, self.memory_limit_bytes, check_cuda=self.device_type == "cuda")
            try:
                if child.cuda_error:
                    raise SandboxInfra(
                        f"CUDA does not initialise inside the sandbox ({child.cuda_error}); "
                        f"its jail shows /dev/nvidia*, /sys, /usr and the library path: is the "
                        f"driver library elsewhere?"
                    )
                if self.gpu_uuid and child.gpus_seen != [self.gpu_uuid]:
                    raise SandboxInfra(
                        f"a sandbox pinned to GPU {self.gpu} (UUID {self.gpu_uuid}) sees {child.gpus_seen}; "
                        f"CUDA_VISIBLE_DEVICES does not pin it (was CUDA initialised in the zygote?)"
                    )
                return dict(child.jail)
            finally:
                child.close()

    @contextmanager
    def session(self, arena_bytes: int = 1 << 16, memory_limit_bytes: int | None = None, memory_capped: bool = False):
        """A fresh sandbox for one candidate; `memory_limit_bytes` (beyond its arena; default the
        pool's floor) is the task's limit (limits.py), `memory_capped` whether the machine capped it below
        the least any candidate needs (limits.SandboxLimits.starved)."""
        asked = time.perf_counter()
        with self._slots:
            waited = time.perf_counter() - asked
            limit = self.memory_limit_bytes if memory_limit_bytes is None else memory_limit_bytes
            child = ChildSession(self, limit, arena_bytes, memory_capped=memory_capped)
            child.waited_s = waited  # time spent queueing for a free slot (run_workers)
            self.children += 1
            try:
                yield child
            finally:
                child.close()

    def close(self) -> None:
        if self.own_zygote:
            self.zygote.close()
