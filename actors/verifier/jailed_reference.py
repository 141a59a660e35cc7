"""A reference's own code in a jailed process of its own: the verifier's side (`JailedProgram`).

A reference a client sent is untrusted code, like its candidate: `kiln serve` takes both from the
same request. So its module, `get_inputs`, `get_init_inputs`, `Model` and `forward`, and its
baselines, run in a process forked from the verifier's zygote (kind "reference") under the layers of
a candidate's sandbox (isolation.reference_jail: its own pid, user, mount, uts, net and ipc
namespaces, a uid of its own, the host tree read-only with Kiln's tree, caches, homes and /tmp hidden,
no file it can write, no network, seccomp, rlimits), plus the filter a sealed sandbox stacks (no new
processes, signals, timers or memory files). No fence: a reference must compute with ATen. The
verifier's logic stays in reference.Reference; this program is only its hands (reference_program.py).

What the verifier believes of it: nothing but data. Requests and replies are small msgpack messages
(wire.py: a length checked before anything is read, at most MAX_REPLY bytes, no pickle); tensors
cross through an arena (arena.py: a memory file this process created; the child maps it and closes
its descriptor before any reference code exists, so it cannot resize the file under this process's
mapping), each read only as a descriptor that checks out (a known dtype, a shape whose bytes are its
size, inside the arena, all of a reply's within the process's memory limit) and copied out at once.
Every request has a deadline (`verifier.reference_timeout_s`, plus the time to move the task's bytes
at limits.COPY_BYTES_PER_S; a baseline measurement baselines.WORKER_TIMEOUT_S), the process's
resident memory is watched (RssWatchdog, a limit sized as a candidate's sandbox's for the task), and
while it times its baselines the device lease is held by this process on its behalf, at most
`hold_s` at a time. A process that crashes, hangs, exceeds its memory or replies garbage is killed,
and its request fails with ReferenceDied (the reference's failure: infra for the task, never the
candidate's); the lane's cache forks a new one for the next request (reference.ReferenceCache).

On cuda the child computes on its GPU (the lane's, pinned by CUDA_VISIBLE_DEVICES) and every tensor
comes back through the host arena: a device-to-host copy there, a host copy into the arena and one
back to this process's device, where the in-process reference hands over device tensors directly
(docs/BENCHMARKS.md gives the cost). The arena is as large as the memory limit's ceiling but sparse:
its pages exist only where a request wrote, and large replies' pages go back to the machine once read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch

from actors.verifier import isolation, limits, proctree, timing, wire
from actors.verifier.arena import Arena
from actors.verifier.baselines import WORKER_TIMEOUT_S
from actors.verifier.isolation import RssWatchdog
from actors.verifier.reference_program import (
    Built,
    Declared,
    DeviceFull,
    ReferenceDied,
    ReferenceError,
    ReferenceProgram,
)
from actors.verifier.sampling import CpuSampler
from actors.verifier.zygote import ExitStatus, Zygote, ZygoteError
from configs import VerifierConfig
from protocols import Task

MAX_REPLY = 1 << 20  # a reply is metadata: tensor descriptors, init arguments, declared constants
MAX_DIMS = 16  # dimensions of a tensor the child may describe
START_TIMEOUT_S = 60.0  # the child's start (its imports, its CUDA context) before it answers `hello`
# Arena bytes a reply used beyond which its pages go back to the machine once read (MADV_REMOVE): a
# gigabyte trial leaves no gigabyte behind in the memory file.
FREE_ABOVE = 16 << 20
# A timed window's hold of the device lease lasts a trip pair (or the warm-up's trips): this many
# calls of the reference at most, each within the request timeout; longer, and the child is killed.
HOLD_CALLS = 8


class ReferenceRaised(Exception):
    """The reference's own code raised inside its process (the message names the exception): handled
    as the same exception in process would be (a shape it rejects is skipped, a forward that fails
    at its own shapes is a broken task)."""


class ReferenceJail:
    """How one lane opens jailed references: its zygote, its settings, its device and GPU."""

    def __init__(
        self, cfg: VerifierConfig, zygote: Zygote, device: str, *, hidden: tuple[str, ...] = (), gpu: str = ""
    ) -> None:
        self.cfg, self.zygote, self.device = cfg, zygote, device
        self.hidden, self.gpu = tuple(hidden), gpu
        # The layers this machine cannot give any sandbox (the verifier's start-up probe): a reference's
        # process that lacks any other is refused before its code exists.
        self.machine_missing: frozenset[str] = frozenset()

    def open(self, task: Task) -> JailedProgram:
        spec = task.kernel
        return JailedProgram(self, task.task_id, spec.reference, spec.source_path or f"<reference {task.task_id}>")


@dataclasses.dataclass(eq=False)
class RemoteModel:
    """A reference model that lives in the jailed process: its handle there, and the elements of its
    parameters and buffers as the child reported them (what a float64 copy would hold)."""

    ident: int
    elements: int


class JailedProgram(ReferenceProgram):
    """One reference source in one jailed process (reference_program.ReferenceProgram's operations
    as requests). Thread-safe: one request at a time, under `lock`, arena reads included."""

    jailed = True

    def __init__(self, jail: ReferenceJail, task_id: str, source: str, filename: str) -> None:
        self.jail, self.task_id = jail, task_id
        self.source, self.filename = source, filename  # a timer process loads the same (baselines)
        self.device = jail.device
        self.device_type = "cuda" if self.device.startswith("cuda") else "cpu"
        self.cfg = jail.cfg
        self.lock = threading.Lock()
        self.dead = ""  # why the process is gone ("" while it serves)
        self.closed = False
        self.trial_bytes = 0  # the largest tensors a request moved, as read here: sizes limits and deadlines
        self._released: list[int] = []  # handles dropped here, to drop there with the next request
        self.scratch = Path(tempfile.mkdtemp(prefix="kiln-reference-"))
        self.work = self.scratch / "work"
        self.work.mkdir()
        os.chmod(self.work, 0o755)
        self.arena = Arena(int(limits.machine_memory_bytes() * limits.MACHINE_SHARE))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spec = isolation.reference_jail(
            str(self.work),
            cuda=self.device_type == "cuda",
            uid=jail.zygote.next_uid(),
            hidden=jail.hidden,
            gpu=jail.gpu,
        )
        try:
            self.spawned = jail.zygote.spawn(
                "reference",
                spec,
                [theirs.fileno(), self.arena.fd],
                str(self.scratch / "output.log"),
                {"device": self.device_type, "arena": self.arena.size},
            )
        except ZygoteError as err:
            ours.close()
            self.arena.close()
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise ReferenceError(f"the sandbox of the reference of {task_id} could not start: {err}") from None
        finally:
            theirs.close()
        self.sock = ours
        self.pid = self.spawned.sandbox or self.spawned.pid
        self.watchdog = RssWatchdog(self.pid, self._memory_limit(0, 0), self.spawned.kill)
        # cpu: sampled as a candidate's sandbox is, so that its baselines pay the same sampling cost
        # (baselines.BaselineProcess); its samples are not kept.
        self.sampler = CpuSampler(self.pid, keep=False) if self.device_type == "cpu" else None
        try:
            with self.lock:
                self.report = self._exchange({"op": "hello"}, START_TIMEOUT_S).get("jail")
                self._check_layers(self.report)
                reply = self._exchange(
                    {"op": "load", "source": source, "filename": filename, "task_id": task_id}, self._timeout()
                )
                self.declared = _declared(reply.get("declared"))
        except ReferenceRaised as err:  # BaseException at import (SystemExit, ...): a load that failed
            self.close()
            raise ReferenceError(f"reference of {task_id} failed to load: {err}") from None
        except BaseException:
            self.close()
            raise

    def _check_layers(self, report) -> None:
        """The jail's report, sent before any reference code existed: every layer the machine gives a
        candidate's sandbox must hold here too (a jail that half failed would run a client's code with
        less than a candidate gets)."""
        missing = report.get("missing") if isinstance(report, dict) else None
        if not isinstance(missing, dict):
            raise self._died("sent no jail report")
        lacking = sorted(str(k) for k in missing if k not in self.jail.machine_missing)
        if lacking:  # closed by the caller, as any failure to start
            raise ReferenceError(
                f"the sandbox of the reference of {self.task_id} lacks layers this machine gives a candidate's: "
                + ", ".join(lacking)
            )

    # ------------------------------------------------------------------------- the program

    @property
    def alive(self) -> bool:
        """False once it failed, was closed, or its process is gone (killed from outside between two
        requests: replaced before the next, rather than failing it)."""
        return not self.dead and not self.closed and proctree.rss_bytes(self.pid) > 0

    def footprint(self, overrides: dict) -> int | None:
        with self.lock:
            found = self._exchange({"op": "footprint", "overrides": overrides}, self._timeout()).get("bytes")
            if found is None:
                return None
            if type(found) is not int or found < 0:
                raise self._died("sent a malformed footprint")
            self.watchdog.limit = max(self.watchdog.limit, self._memory_limit(found, 0))  # a claim: capped
            return found

    def build(self, overrides: dict, seed: int) -> Built:
        with self.lock:
            reply = self._exchange({"op": "build", "overrides": overrides, "seed": seed}, self._timeout())
            ident, elements, state = reply.get("handle"), reply.get("elements"), reply.get("state")
            if type(ident) is not int or type(elements) is not int or elements < 0 or not isinstance(state, list):
                raise self._died("sent a malformed model")
            init = reply.get("init")
            if not isinstance(init, list):
                raise self._died("sent malformed init arguments")
            names = [entry[0] if isinstance(entry, list) and len(entry) == 2 else None for entry in state]
            if any(not isinstance(n, str) or len(n) > 1024 for n in names) or len(set(names)) != len(names):
                raise self._died("sent a malformed state dict")
            tensors = self._tensors([entry[1] for entry in state], device="cpu")
            model = RemoteModel(ident, elements)
            weakref.finalize(model, self._release, ident)
            return Built(init, dict(zip(names, tensors, strict=True)), model)

    def draw(self, overrides: dict, seed: int) -> list:
        with self.lock:
            reply = self._exchange({"op": "draw", "overrides": overrides, "seed": seed}, self._timeout())
            return self._values(reply.get("inputs"))

    def forward(
        self, model, inputs: list, *, overrides: dict | None = None, wide: bool = False, wait: bool = True
    ) -> list[torch.Tensor]:
        if not isinstance(model, RemoteModel):
            raise TypeError("a jailed reference runs only the models it built")
        with self.lock:
            self._alive()
            self.arena.reset()
            entries = [self.arena.put(x) for x in inputs]
            self.trial_bytes = max(self.trial_bytes, self.arena.used)
            body = {"op": "forward", "handle": model.ident, "inputs": entries, "overrides": overrides, "wide": wide}
            reply = self._exchange(body, self._timeout())
            outputs = reply.get("outputs")
            if not isinstance(outputs, list) or any(isinstance(x, dict) for x in outputs):
                raise self._died("sent malformed outputs")
            return self._values(outputs)

    def elements(self, model) -> int:
        return model.elements

    def baselines(self, overrides: dict, pairs: int, warmup: int, lease) -> tuple[timing.TripTimes, str]:
        """The eager baseline at `overrides`, timed by baselines.measure_reference (a fresh instance
        and fresh draws, as the baseline process times one) in a jailed process of this reference's
        own, started for the measurement and ended after it, the device lease held here on its
        behalf. (eager, a note).

        Never in this program's process: other runs of the task draw and run forward there, each
        holding the shared lease while it waits for this program's lock, and a measurement holding
        that lock while it waits for the exclusive lease would wait for them: a deadlock (a
        two-step demo against `kiln serve` hung so, session 33). A fresh process a measurement is
        also what `forget_baselines(new_processes=True)` asks of the baseline process."""
        timer = JailedProgram(self.jail, self.task_id, self.source, self.filename)
        try:
            return timer._time_baselines(overrides, pairs, warmup, lease)
        finally:
            timer.close()

    def _time_baselines(self, overrides: dict, pairs: int, warmup: int, lease) -> tuple[timing.TripTimes, str]:
        with self.lock:
            body = {"op": "baselines", "overrides": overrides, "pairs": pairs, "warmup": warmup}
            reply = self._exchange(body, WORKER_TIMEOUT_S, lease=lease)
            eager = _trip_times(reply.get("eager"), self.device_type)
            note = reply.get("note")
            if eager is None or not isinstance(note, str):
                raise self._died("sent malformed baseline timings")
            return eager, _line(note)

    def close(self) -> None:
        """End the process (it is asked first), and free what it held here."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if not self.dead:
                with contextlib.suppress(OSError, wire.WireError):
                    wire.send(self.sock, {"op": "close"})
                    self.sock.settimeout(2.0)
                    with contextlib.suppress(OSError):
                        self.sock.recv(1)  # its end closes when it exits
            self._stop()
            self.sock.close()
            self.arena.close()
            shutil.rmtree(self.scratch, ignore_errors=True)
            shutil.rmtree(f"{self.work}.root", ignore_errors=True)

    # --------------------------------------------------------------------------- requests

    def _exchange(self, body: dict, timeout_s: float, lease=None) -> dict:
        """Send one request and return its reply once it checks out; with `lease`, serve the child's
        lease messages meanwhile. Under `lock`. Any failure of the process raises ReferenceDied."""
        self._alive()
        dropped, self._released = self._released, []  # a handle collected meanwhile waits for the next
        if dropped:
            body = {**body, "drop": dropped}
        deadline = time.monotonic() + timeout_s
        held, hold_until = None, None
        try:
            wire.send(self.sock, body)
            while True:
                until = deadline if hold_until is None else min(deadline, hold_until)
                try:
                    msg = wire.recv(self.sock, until, MAX_REPLY)
                except wire.PeerTimeout:
                    if hold_until is not None and time.monotonic() >= hold_until:
                        raise self._died(f"held the device lease more than {self._hold_s():.0f} s") from None
                    raise self._died(f"did not answer within {timeout_s:.0f} s") from None
                if not isinstance(msg, dict):
                    raise self._died("sent a reply that is not a map")
                if lease is None or "lease" not in msg:
                    return self._checked(msg)
                held, hold_until = self._serve_lease(msg, held, lease)
        except (wire.PeerClosed, ConnectionError):
            raise self._died("ended") from None
        except (wire.WireError, OSError) as err:
            raise self._died(f"sent a malformed message ({_line(str(err))})") from None
        finally:
            if held is not None:
                held.close()

    def _serve_lease(self, msg: dict, held, lease):
        """The child's ask for the device lease (shared or exclusive: granted when this process
        holds it for the child) or its release. One hold at a time, each bounded by `_hold_s`."""
        mode = msg.get("lease")
        if mode == "release" and held is not None:
            held.close()
            return None, None
        if mode in ("shared", "exclusive") and held is None:
            held = contextlib.ExitStack()
            held.enter_context(lease.exclusive() if mode == "exclusive" else lease.shared())
            wire.send(self.sock, {"granted": True})
            return held, time.monotonic() + self._hold_s()
        raise wire.WireError(f"an unexpected lease message ({str(mode)[:40]!r})")

    def _checked(self, reply: dict) -> dict:
        """A reply that says ok, or the failure it reports, raised as in process: ReferenceRaised for
        the reference's own exception, DeviceFull for device memory, ReferenceError for the rest."""
        if reply.get("ok") is True:
            return reply
        kind, error = reply.get("kind"), _line(reply.get("error"))
        if kind == "raised":
            raise ReferenceRaised(error)
        if kind == "oom":
            raise DeviceFull(error)
        if kind == "reference":
            raise ReferenceError(error)
        raise self._died("sent a malformed reply")

    def _values(self, entries) -> list:
        """Inputs or outputs as the child placed them: tensors (read from the arena onto the reference's
        device) and plain values ({"v": value})."""
        if not isinstance(entries, list):
            raise self._died("sent malformed tensors")
        tensors = self._tensors([e for e in entries if not isinstance(e, dict)], device=self.device)
        out, it = [], iter(tensors)
        for entry in entries:
            if isinstance(entry, dict):
                if set(entry) != {"v"}:
                    raise self._died("sent a malformed value")
                out.append(entry["v"])
            else:
                out.append(next(it))
        return out

    def _tensors(self, entries: list, device: str) -> list[torch.Tensor]:
        """Each descriptor read from the arena, copied out onto `device`, once every one checks out: a
        known dtype, a shape of at most MAX_DIMS whose bytes are its size, inside the arena, and all of
        them within the process's memory limit (so no reply makes this process copy more)."""
        metas, total, span = [], 0, 0
        for entry in entries:
            meta = _described(entry, self.arena.size)
            if meta is None:
                raise self._died("described a tensor that is not in its arena")
            metas.append(meta)
            total += entry[1]
            span = max(span, entry[0] + entry[1])
        if total > self.watchdog.limit:
            raise self._died(f"sent {total >> 20} MB of tensors, more than its memory limit")
        copy_to = device if device.startswith("cuda") else None
        out = [self.arena.take(e, m, device=copy_to) for e, m in zip(entries, metas, strict=True)]
        if any(t is None for t in out):
            raise self._died("described a tensor that is not in its arena")
        if span > FREE_ABOVE:
            self.arena.map.madvise(mmap.MADV_REMOVE, 0, -(-span // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.trial_bytes = max(self.trial_bytes, total)
        self.watchdog.limit = max(self.watchdog.limit, self._memory_limit(self.trial_bytes, 0))
        return out

    # ------------------------------------------------------------------------------ limits

    def _timeout(self) -> float:
        """A request's deadline: the configured seconds, plus the time to move the task's bytes (as
        read here, never as the child claims) at limits.COPY_BYTES_PER_S, as a sandbox's grows."""
        moved = 4 * self.trial_bytes  # in and out of the arena, both ways
        return self.cfg.reference_timeout_s + math.ceil(moved / limits.COPY_BYTES_PER_S)

    def _hold_s(self) -> float:
        return HOLD_CALLS * self._timeout()

    def _memory_limit(self, trial_bytes: int, param_bytes: int) -> int:
        """The process's memory limit for a task of `trial_bytes`: a candidate's sandbox's for the same
        task (limits.derive: the configured floor, or the process and its copies of a trial), with
        room for the arena pages it writes (a trial each way) and its float64 run; never more than
        the machine gives one sandbox."""
        from actors.verifier.reference import FLOAT64_MAX_BYTES

        derived = limits.derive(
            self.device, self.cfg.memory_limit_mb, 0.0, trial_bytes, 0, 2 * trial_bytes, param_bytes=param_bytes
        )
        cap = int(derived.machine_bytes * limits.MACHINE_SHARE)
        return min(derived.memory_bytes + min(8 * trial_bytes, FLOAT64_MAX_BYTES), cap)

    # ------------------------------------------------------------------------------- death

    def _alive(self) -> None:
        if self.closed:
            raise ReferenceDied(f"the sandboxed reference of {self.task_id} was closed")
        if self.dead:
            raise ReferenceDied(self.dead)

    def _died(self, why: str) -> ReferenceDied:
        """Kill the process and say why it is gone, in one line; every later request fails the same way."""
        status = self._stop()
        if self.watchdog.tripped:
            why = f"exceeded its memory limit of {self.watchdog.limit >> 20} MB"
        elif why == "ended":
            why = f"ended ({status.describe()})"
        self.dead = f"the sandboxed reference of {self.task_id} {why} and was stopped (the reference's failure)"
        return ReferenceDied(self.dead)

    def _stop(self) -> ExitStatus:
        """Kill the process tree (if alive), reap its warden, and stop watching it."""
        self.spawned.kill()
        try:
            status = self.jail.zygote.reap(self.spawned.pid, timeout_s=5.0)
        except ZygoteError:  # the zygote went away: its children went with it
            status = ExitStatus(None, None)
        self.watchdog.stop()
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        self.spawned.close()
        return status

    def _release(self, ident: int) -> None:
        """A model's handle was dropped here (any thread, at collection): drop it there next time."""
        self._released.append(ident)


def _described(entry, arena_size: int) -> torch.Tensor | None:
    """The meta tensor a descriptor [offset, nbytes, dtype, shape] promises, or None if it does not
    check out (the arena's `take` checks the same bytes again)."""
    if not isinstance(entry, list) or len(entry) != 4:
        return None
    from actors.verifier.sandbox import DTYPES  # here, as arena.py does: the verifier never needs the rest

    offset, nbytes, name, shape = entry
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        return None
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None or not isinstance(shape, list) or len(shape) > MAX_DIMS:
        return None
    if any(type(d) is not int or d < 0 for d in shape):
        return None
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if size != nbytes or offset + nbytes > arena_size:
        return None
    return torch.empty(shape, dtype=dtype, device="meta")


def _hashable(value, depth: int = 0):
    """A declared constant as a plain, hashable value (lists become tuples), or ValueError."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and depth < 8:
        return tuple(_hashable(v, depth + 1) for v in value)
    raise ValueError(f"a declared constant of type {type(value).__name__}")


def _constants(value) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError("declared constants that are not a map of names")
    return {k: _hashable(v) for k, v in value.items()}


def _declared(data) -> Declared:
    """What the child read from the module (Declared), checked: constants are plain values, the
    tolerance two finite, non-negative numbers."""
    try:
        if not isinstance(data, dict):
            raise TypeError("not a map")
        cpu, alts, tol = data.get("cpu_shapes"), data.get("alt_shapes"), data.get("tolerance")
        if alts is not None and not isinstance(alts, list):
            raise ValueError("alternative shapes that are not a list")
        if tol is not None:
            if not (isinstance(tol, list) and len(tol) == 2 and all(isinstance(x, (int, float)) for x in tol)):
                raise ValueError("a malformed tolerance")
            if not all(math.isfinite(x) and x >= 0 for x in tol):
                raise ValueError("a tolerance that is not a finite, non-negative number")
        return Declared(
            _constants(data.get("defaults")),
            _constants(cpu) if cpu is not None else None,
            [_constants(a) for a in alts] if alts is not None else None,
            (float(tol[0]), float(tol[1])) if tol is not None else None,
        )
    except (TypeError, ValueError) as err:
        raise ReferenceError(f"a sandboxed reference declared its shapes in a form Kiln cannot read ({err})") from None


_TRIP_LISTS = ("calls", "first_calls", "per_call", "trips", "nulls")


def _trip_times(data, device_type: str) -> timing.TripTimes | None:
    """A baseline's TripTimes from the child's fields, or None where they do not check out: a positive
    calls per trip, this device's type, finite figures (non-negative but the pairs' differences), at
    least one timed call."""
    fields = {f.name for f in dataclasses.fields(timing.TripTimes)}
    if not isinstance(data, dict) or not set(data) <= fields or data.get("device_type") != device_type:
        return None
    k = data.get("calls_per_trip")
    if type(k) is not int or k < 1 or type(data.get("trusted_calls", False)) is not bool:
        return None
    for name in _TRIP_LISTS:
        values = data.get(name, [])
        if not isinstance(values, list) or not all(_figure(x, signed=name == "per_call") for x in values):
            return None
    order = data.get("run_first", [])
    if not isinstance(order, list) or not all(isinstance(x, bool) for x in order) or not data.get("calls"):
        return None
    return timing.TripTimes(**data)


def _figure(x, *, signed: bool) -> bool:
    """A finite number of seconds; negative only where a difference of two trips may be (per_call)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and (signed or x >= 0)


def _line(text) -> str:
    """One line of at most 300 characters of what the child said."""
    first = str(text or "").strip().splitlines()
    return first[0][:300] if first else "no reason given"
