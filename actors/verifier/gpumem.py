"""Whose device memory: the driver's figure for a sandbox, and the rules that decide an out-of-memory.

A candidate that fills the GPU makes whatever allocates next fail: the verifier's own reference draws
and runs, the baseline process, another run's sandbox. Who failed says nothing about who filled the
device, and nothing the sandbox says about itself counts (allocator counters inside it are the
candidate's to forge). So an out-of-memory is judged by evidence from outside the candidate's
process, taken while the sandbox is still alive:

* the driver's figure of the device memory the sandbox's processes hold (NVML's per-process used
  memory, read here through libnvidia-ml, by the sandbox's pid in this host's PID namespace:
  `executor.ChildSession.sandbox_pid`);
* where the driver cannot name the sandbox's processes (a container whose PID namespace is not the
  driver's), the memory the device gets back when the verifier kills the sandbox (`freed_by_kill`):
  the run ends anyway once its trusted side could not go on;
* the device's free memory (the driver's, as torch reads it).

A candidate that fills the device is also stopped while it does: `DeviceWatch` (one per GPU, in the
verifier's process) reads the driver's per-process figures every WATCH_POLL_S and kills a sandbox
that holds more than OVERRUN_FACTOR times its share while the device has less than LOW_WATER_BYTES
free. That is its
`runtime` (it filled the device), and it is an `Overrun` on the watch's record: an out-of-memory of
another run on the same GPU, in a window that overlaps an overrun, is the machine's (`infra`), not
that run's, whatever its own figures say later (the filler is gone by then, and the device free).

Rules (pure functions, tested on cpu):
* `trusted_oom`: the verifier's own work on the device ran out of memory while a sandbox was alive.
  The candidate's (`runtime`, score -1) when its sandbox held more than its share, the device memory
  its run reserved for it (devmem.py) plus the parameters of its ModelNew twice plus a context's
  allowance (`share`); the machine's (`infra`, score 0, not trained on) otherwise, and where no
  figure could be taken.
* `sandbox_oom`: the candidate's own code reported a CUDA out-of-memory. The machine's (`infra`) only
  when the driver says the device could not give the sandbox its share (what it held and what was
  free fall short of it): other processes crowded it out. Otherwise the candidate's (`runtime`), as
  any error of its own (it asked beyond its share, or no figure could be taken): the text alone
  (which the candidate writes) never makes a verdict `infra`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

# What a sandbox may hold on the device beyond its run's reservation and its weights: the CUDA
# context, the libraries' workspaces (cuBLAS, cuDNN) and the caching allocator's slack.
CONTEXT_BYTES = 2 << 30
PARAM_COPIES = 2  # its ModelNew's parameters on the device, and the reference's copied in
KILL_SETTLE_S = 3.0  # how long the device's free memory is watched after the sandbox is killed
# The device watch: how often it reads the driver's figures; how little free memory makes a sandbox
# far over its share a filler (less than a context's allowance: no other run could start); and how far
# over it must be (the share is an estimate: an honest kernel a little over it on a device that is
# full for other reasons, a colocated engine's cache, is not stopped).
WATCH_POLL_S = 0.02
LOW_WATER_BYTES = CONTEXT_BYTES
OVERRUN_FACTOR = 2
_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE


@dataclass(frozen=True)
class Evidence:
    """What the verifier saw of one sandbox's device memory when an out-of-memory happened."""

    held: int | None  # bytes its processes held, by the driver (None: no figure could be taken)
    share: int  # bytes it may hold (`share`)
    how: str  # where `held` comes from ("the driver's per-process figure", ...)
    free: int | None = None  # the device's free bytes then (None: unknown)
    total: int | None = None  # the device's bytes

    def to_json(self) -> dict:
        return {
            "held_mb": _mb(self.held),
            "share_mb": _mb(self.share),
            "how": self.how,
            "free_mb": _mb(self.free),
            "total_mb": _mb(self.total),
        }


def _mb(nbytes: int | None) -> int | None:
    return None if nbytes is None else nbytes >> 20


def share(reserved_bytes: int, param_bytes: int) -> int:
    """The device memory a sandbox may hold: what its run reserved (devmem.py: its trials, the
    candidate's workspace), its ModelNew's parameters twice, and a context's allowance."""
    return max(int(reserved_bytes), 0) + PARAM_COPIES * max(int(param_bytes), 0) + CONTEXT_BYTES


def crowded(evidence: Evidence) -> bool:
    """The device could not give the sandbox its share: what it held and what was free fall short."""
    if evidence.held is None or evidence.free is None:
        return False
    return evidence.held + evidence.free < evidence.share


def trusted_oom(evidence: Evidence) -> tuple[str, str]:
    """(error class, message) for the verifier's own work running out of device memory while the
    sandbox was alive (the module docstring)."""
    if evidence.held is not None and evidence.held > evidence.share:
        return "runtime", (
            f"the candidate's process held {evidence.held >> 20} MB of device memory ({evidence.how}), more than "
            f"its share of {evidence.share >> 20} MB, and the verifier's own work on the device ran out of memory: "
            "a kernel that fills the device fails"
        )
    held = "an unknown amount" if evidence.held is None else f"{evidence.held >> 20} MB"
    return "infra", (
        f"the verifier's device ran out of memory while the candidate's process held {held} of it "
        f"(its share: {evidence.share >> 20} MB): the machine's fault (another run, or the verifier's own crowding)"
    )


def overran(held: int, share_bytes: int, free: int) -> bool:
    """The device watch's rule: a sandbox that holds more than OVERRUN_FACTOR times its share while the
    device has less than LOW_WATER_BYTES free is filling it (over its share with room to spare, it
    harms no one)."""
    return held > OVERRUN_FACTOR * share_bytes and free < LOW_WATER_BYTES


def overrun_message(evidence: Evidence) -> str:
    """The verdict's message for a sandbox the device watch stopped."""
    return (
        f"the candidate's process held {(evidence.held or 0) >> 20} MB of device memory ({evidence.how}), more "
        f"than its share of {evidence.share >> 20} MB, while the device had {(evidence.free or 0) >> 20} MB free: "
        "it was stopped for filling the device"
    )


def crowded_out(overruns: list[Overrun]) -> str:
    """The note for an out-of-memory during another sandbox's overrun (the machine's, not this run's)."""
    o = overruns[0]
    return (
        f"another run's sandbox on this device held {o.held >> 20} MB, more than its share of {o.share >> 20} MB, "
        f"with {o.free >> 20} MB of the device free, and was stopped: it crowded this run out (the machine's fault)"
    )


def sandbox_oom(evidence: Evidence) -> tuple[str, str]:
    """(error class, note) for a CUDA out-of-memory the candidate's own code reported (the module
    docstring): `infra` only on the driver's word that the device could not give the sandbox its
    share."""
    if crowded(evidence):
        return "infra", (
            f"the device had {(evidence.free or 0) >> 20} MB free while the candidate's process held "
            f"{(evidence.held or 0) >> 20} MB, short of its share of {evidence.share >> 20} MB: other processes "
            "crowded it out (the machine's fault)"
        )
    return "runtime", ""


# ------------------------------------------------------------------------------- the figures


def take(session, device: str, gpu_uuid: str, share_bytes: int, *, may_kill: bool) -> Evidence:
    """The evidence about `session`'s sandbox (an executor.ChildSession, alive) on `device` ("cuda:N",
    the verifier's view; `gpu_uuid` its UUID): the driver's per-process figure, else, when `may_kill`,
    what the device gets back when the sandbox is killed."""
    free, total = device_memory(device)
    pids = set(_tree(session.sandbox_pid))
    held = process_bytes(gpu_uuid, pids)
    if held is not None:
        return Evidence(held, share_bytes, "the driver's per-process figure", free, total)
    if may_kill:
        freed = freed_by_kill(session, device)
        if freed is not None:
            return Evidence(freed, share_bytes, "what the device got back when the sandbox was killed", free, total)
    return Evidence(None, share_bytes, "no figure: the driver names no process of the sandbox", free, total)


def device_memory(device: str) -> tuple[int | None, int | None]:
    """(free, total) bytes of the device, as the driver says (None, None where it cannot)."""
    try:
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), int(total)
    except Exception:  # noqa: BLE001 - no CUDA here, or the device failed: no figure
        return None, None


def freed_by_kill(session, device: str, settle_s: float = KILL_SETTLE_S) -> int | None:
    """Kill the sandbox and watch the device's free memory: what it gets back (the most over
    `settle_s`, once the process is gone) is what the sandbox held."""
    before, _ = device_memory(device)
    if before is None:
        return None
    session.kill()
    best = 0
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        free, _ = device_memory(device)
        if free is not None:
            best = max(best, free - before)
        time.sleep(0.05)
    return best


def _tree(pid: int) -> list[int]:
    from actors.verifier import proctree

    return [pid, *proctree.descendants(pid, limit=1024)]


def process_bytes(gpu_uuid: str, pids: set[int]) -> int | None:
    """The device memory the processes `pids` hold on the GPU `gpu_uuid`, by NVML; None when NVML is
    not there or names none of them (a process the driver sees in another PID namespace)."""
    nvml = _nvml()
    if nvml is None or not gpu_uuid:
        return None
    try:
        return nvml.process_bytes(gpu_uuid, pids)
    except OSError as err:
        log.debug("NVML: %s", err)
        return None


class _ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t of the _v2/_v3 calls
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class _MemoryInfo(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class Nvml:
    """libnvidia-ml through ctypes, in the verifier's own (trusted) process only."""

    def __init__(self, lib) -> None:
        self.lib = lib
        self._lock = threading.Lock()
        self._call("nvmlInit_v2")

    def _call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise OSError(f"{name} returned {rc}")

    def _handle(self, gpu_uuid: str) -> ctypes.c_void_p:
        uuid = gpu_uuid if gpu_uuid.startswith(("GPU-", "MIG-")) else f"GPU-{gpu_uuid}"
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByUUID", uuid.encode(), ctypes.byref(handle))
        return handle

    def reading(self, gpu_uuid: str) -> tuple[int, int, list]:
        """(free, total, per-process infos) of the GPU, in one look."""
        with self._lock:
            handle = self._handle(gpu_uuid)
            memory = _MemoryInfo()
            self._call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(memory))
            return int(memory.free), int(memory.total), self._processes(handle)

    def process_bytes(self, gpu_uuid: str, pids: set[int]) -> int | None:
        with self._lock:
            infos = self._processes(self._handle(gpu_uuid))
        held = [p.usedGpuMemory for p in infos if p.pid in pids and p.usedGpuMemory != _NOT_AVAILABLE]
        return sum(held) if held else None

    def _processes(self, handle) -> list:
        for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
            fn = getattr(self.lib, name, None)
            if fn is None:
                continue
            count = ctypes.c_uint(64)
            for _ in range(4):
                buf = (_ProcessInfo * count.value)()
                rc = fn(handle, ctypes.byref(count), buf)
                if rc == 0:
                    return list(buf[: count.value])
                if rc != 7:  # NVML_ERROR_INSUFFICIENT_SIZE: count now says how many
                    raise OSError(f"{name} returned {rc}")
                count = ctypes.c_uint(count.value + 16)
        raise OSError("this NVML has no per-process memory query")


@functools.lru_cache(maxsize=1)
def _nvml() -> Nvml | None:
    for name in ("libnvidia-ml.so.1", "libnvidia-ml.so"):
        try:
            return Nvml(ctypes.CDLL(name))
        except OSError:
            continue
    return None


# ------------------------------------------------------------------------------- the device watch


@dataclass(frozen=True)
class Overrun:
    """A sandbox the device watch stopped: when, and the driver's figures then."""

    at: float  # time.monotonic()
    sandbox_pid: int
    held: int
    share: int
    free: int
    total: int


class Watched:
    """One sandbox under the device watch (`DeviceWatch.watch`); `overrun` is set if it was stopped."""

    def __init__(self, session, share_bytes: int) -> None:
        self.session = session
        self.share = int(share_bytes)
        self.since = time.monotonic()
        self.overrun: Evidence | None = None


class DeviceWatch:
    """The driver's per-process device memory of every watched sandbox on one GPU, read every
    WATCH_POLL_S; a sandbox that `overran` is killed and recorded (the module docstring)."""

    def __init__(self, nvml: Nvml, gpu_uuid: str, poll_s: float = WATCH_POLL_S) -> None:
        self.nvml, self.uuid, self.poll_s = nvml, gpu_uuid, poll_s
        self._lock = threading.Lock()
        self._watched: dict[int, Watched] = {}  # by sandbox pid
        self._owner: dict[int, int | None] = {}  # a device-holding pid -> the watched sandbox pid above it
        self.overruns: list[Overrun] = []
        self._thread: threading.Thread | None = None

    def watch(self, session, share_bytes: int) -> Watched:
        entry = Watched(session, share_bytes)
        with self._lock:
            self._watched[session.sandbox_pid] = entry
            self._owner.clear()  # pids seen before may belong to this sandbox now
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kiln-device-watch", daemon=True)
                self._thread.start()
        return entry

    def unwatch(self, entry: Watched) -> None:
        with self._lock:
            if self._watched.get(entry.session.sandbox_pid) is entry:
                del self._watched[entry.session.sandbox_pid]
            self._owner.clear()

    def overruns_since(self, since: float, exclude: Watched | None = None) -> list[Overrun]:
        """Overruns of other sandboxes at or after `since` (a run's start): a window in which any
        out-of-memory on this GPU is the filler's doing."""
        pid = exclude.session.sandbox_pid if exclude is not None else None
        with self._lock:
            return [o for o in self.overruns if o.at >= since and o.sandbox_pid != pid]

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            try:
                self.look()
            except OSError as err:  # the driver refused a query: nothing decided this round
                log.debug("device watch: %s", err)

    def look(self) -> None:
        """One reading: every watched sandbox's bytes, and the kill of one that overran."""
        with self._lock:
            if not self._watched:
                return
        free, total, infos = self.nvml.reading(self.uuid)
        held: dict[int, int] = {}
        with self._lock:
            for info in infos:
                if info.usedGpuMemory == _NOT_AVAILABLE:
                    continue
                owner = self._owner.get(info.pid, -1)
                if owner == -1:
                    owner = self._owner[info.pid] = _watched_ancestor(info.pid, self._watched)
                if owner is not None:
                    held[owner] = held.get(owner, 0) + int(info.usedGpuMemory)
            stop = [
                (self._watched[pid], n)
                for pid, n in held.items()
                if pid in self._watched
                and self._watched[pid].overrun is None
                and overran(n, self._watched[pid].share, free)
            ]
            for entry, n in stop:
                entry.overrun = Evidence(
                    n, entry.share, "the driver's per-process figure, by the device watch", free, total
                )
                self.overruns.append(Overrun(time.monotonic(), entry.session.sandbox_pid, n, entry.share, free, total))
                del self.overruns[:-MAX_OVERRUNS]
        for entry, _ in stop:
            entry.session.kill()


MAX_OVERRUNS = 256  # the watch's record is bounded: the oldest go first


def _watched_ancestor(pid: int, watched: dict[int, Watched]) -> int | None:
    """The watched sandbox pid at or above `pid` in the process tree, or None."""
    for _ in range(64):
        if pid in watched:
            return pid
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None
        if pid <= 1:
            return None
    return None


_WATCHES: dict[str, DeviceWatch] = {}
_WATCHES_LOCK = threading.Lock()


def device_watch(gpu_uuid: str) -> DeviceWatch | None:
    """The process's watch of the GPU `gpu_uuid` (one per GPU), or None without NVML or a UUID."""
    nvml = _nvml()
    if nvml is None or not gpu_uuid:
        return None
    with _WATCHES_LOCK:
        if gpu_uuid not in _WATCHES:
            _WATCHES[gpu_uuid] = DeviceWatch(nvml, gpu_uuid)
        return _WATCHES[gpu_uuid]
