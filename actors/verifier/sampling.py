"""Where a sandbox's threads execute, sampled from outside it: the evidence of cpu provenance.

The verifier (trusted) opens Linux perf events on the sandbox's process, one per CPU of the host
(`perf_event_open(pid, cpu)` with `inherit`, so every thread the sandbox starts later is sampled
too), and maps their ring buffers into its own memory. The kernel writes a sample (the instruction
pointer, the thread and a CLOCK_MONOTONIC time) every `PERIOD_NS` of a thread's CPU time, in user
mode only. Nothing of this is in the sandbox's reach: the events belong to the verifier's file
descriptors, the sandbox's seccomp filter refuses `perf_event_open` anyway, and no sample passes
through the candidate's process. A thread cannot hide from them: its CPU time is what they count.

A drain thread here empties every live sampler's buffers every `DRAIN_S`, so a long request loses
nothing to a full buffer; samples the kernel could not write are counted (`lost`). At most
`MAX_SAMPLES` are kept per sampler (the rest are counted as `dropped`): memory stays bounded however
long a candidate runs.

Where the events cannot be opened (no permission, a kernel without perf events, a seccomp'd
container), `CpuSampler.available` is False with the reason: the verdict then says provenance was
not observed (provenance.py), never that it held.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import threading
import time
from array import array
from dataclasses import dataclass

# A sample every 200 us of a thread's CPU time: 5 per millisecond of forward. Each sample costs the
# sampled process about 25 us in a virtual machine (the timer's interrupt leaves the guest), so this
# period costs it about 12%; the baseline process is sampled at the same period for that reason
# (baselines.py). docs/verifier.md gives the statistical power it buys and the overhead measured.
PERIOD_NS = 200_000
DRAIN_S = 0.02
DATA_PAGES = 64  # a power of two: 256 KiB of samples per CPU between two drains (about 400 ms of one busy thread)
MAX_SAMPLES = 2_000_000  # per sandbox: 40 s of one busy thread (32 MB of arrays)

_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}.get(platform.machine())
_PERF_TYPE_SOFTWARE, _PERF_COUNT_SW_TASK_CLOCK = 1, 1
_SAMPLE_IP, _SAMPLE_TID, _SAMPLE_TIME = 1, 2, 4
_FLAG_DISABLED, _FLAG_INHERIT, _FLAG_EXCLUDE_KERNEL, _FLAG_EXCLUDE_HV, _FLAG_USE_CLOCKID = (
    1 << 0,
    1 << 1,
    1 << 5,
    1 << 6,
    1 << 25,
)
_PERF_FLAG_FD_CLOEXEC = 8
_PERF_EVENT_IOC_ENABLE = 0x2400
_RECORD_LOST, _RECORD_SAMPLE = 2, 9
_CLOCK_MONOTONIC = 1
_PAGE = mmap.PAGESIZE
_HEAD_AT, _TAIL_AT, _DATA_AT = 1024, 1032, 1040  # perf_event_mmap_page: data_head, data_tail, data_offset/size


class _Attr(ctypes.Structure):
    """struct perf_event_attr (PERF_ATTR_SIZE_VER8, 136 bytes)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),
        ("aux_sample_size", ctypes.c_uint32),
        ("reserved_3", ctypes.c_uint32),
        ("sig_data", ctypes.c_uint64),
        ("config3", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Samples:
    """What was sampled: parallel arrays of times (ns, CLOCK_MONOTONIC), threads and instruction
    pointers, plus the samples the kernel could not write (`lost`) and those not kept (`dropped`)."""

    times: array
    tids: array
    ips: array
    lost: int
    dropped: int
    period_ns: int


class CpuSampler:
    """The sampled instruction pointers of one process (`pid`, the verifier's view of it) and of
    every thread it starts from now on. `available` says whether the events could be opened here,
    `why` says why not."""

    def __init__(self, pid: int, period_ns: int = PERIOD_NS, *, keep: bool = True) -> None:
        self.pid, self.period_ns, self.keep = pid, period_ns, keep
        self.available, self.why = False, ""
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._times, self._tids, self._ips = array("Q"), array("I"), array("Q")
        self.lost = self.dropped = 0
        self._lock = threading.Lock()
        try:
            self._open()
            self.available = True
        except OSError as err:
            self.why = f"perf events cannot be opened here ({err.strerror or err})"
            self._close_events()
            return
        _DRAINER.add(self)

    def _open(self) -> None:
        if _NR_PERF_EVENT_OPEN is None:
            raise OSError(errno.ENOSYS, f"no perf_event_open system call number for {platform.machine()}")
        attr = _Attr()
        attr.type, attr.size, attr.config = _PERF_TYPE_SOFTWARE, ctypes.sizeof(_Attr), _PERF_COUNT_SW_TASK_CLOCK
        attr.sample_period = self.period_ns
        attr.sample_type = _SAMPLE_IP | _SAMPLE_TID | _SAMPLE_TIME
        # Disabled until every CPU's buffer is mapped; inherited by every thread the process starts;
        # user-mode instruction pointers only (no privilege needed beyond access to the process).
        attr.flags = _FLAG_DISABLED | _FLAG_INHERIT | _FLAG_EXCLUDE_KERNEL | _FLAG_EXCLUDE_HV | _FLAG_USE_CLOCKID
        attr.clockid = _CLOCK_MONOTONIC  # the same clock as the verifier's time.monotonic()
        # Inherited per-task events cannot share one buffer (the kernel refuses mmap with cpu -1):
        # one event, and one buffer, per CPU, as `perf record -p` does.
        for cpu in range(os.cpu_count() or 1):
            fd = _libc.syscall(_NR_PERF_EVENT_OPEN, ctypes.byref(attr), self.pid, cpu, -1, _PERF_FLAG_FD_CLOEXEC)
            if fd < 0:
                code = ctypes.get_errno()
                if code == errno.ENODEV or code == errno.EINVAL and cpu > 0:  # an offline CPU
                    continue
                raise OSError(code, os.strerror(code))
            self._fds.append(fd)
            self._maps.append(
                mmap.mmap(fd, (1 + DATA_PAGES) * _PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            )
        if not self._fds:
            raise OSError(errno.ENODEV, "no CPU accepted the event")
        for fd in self._fds:
            if _libc.ioctl(fd, _PERF_EVENT_IOC_ENABLE, 0) < 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))

    # ---------------------------------------------------------------------------- reading

    def drain(self) -> None:
        """Move every buffer's new records into this sampler's arrays (never blocks)."""
        with self._lock:
            for buf in self._maps:
                self._drain_one(buf)

    def _drain_one(self, buf: mmap.mmap) -> None:
        (head,) = struct.unpack_from("<Q", buf, _HEAD_AT)
        (tail,) = struct.unpack_from("<Q", buf, _TAIL_AT)
        offset, size = struct.unpack_from("<QQ", buf, _DATA_AT)
        if not size:
            offset, size = _PAGE, DATA_PAGES * _PAGE
        keep = MAX_SAMPLES - len(self._times) if self.keep else 0
        while tail < head:
            at = offset + tail % size
            kind, _misc, length = struct.unpack_from("<IHH", _wrapped(buf, at, 8, offset, size))
            if length < 8:  # a corrupt header: give the rest of this buffer up
                tail = head
                break
            if kind == _RECORD_SAMPLE and length >= 32:
                ip, _pid, tid, when = struct.unpack_from("<QIIQ", _wrapped(buf, at + 8, 24, offset, size))
                if keep > 0:
                    self._times.append(when)
                    self._tids.append(tid)
                    self._ips.append(ip)
                    keep -= 1
                elif self.keep:
                    self.dropped += 1
            elif kind == _RECORD_LOST and length >= 24:
                (_id, count) = struct.unpack_from("<QQ", _wrapped(buf, at + 8, 16, offset, size))
                self.lost += count
            tail += length
        struct.pack_into("<Q", buf, _TAIL_AT, tail)

    def samples(self) -> Samples:
        """Everything sampled so far (drained first)."""
        self.drain()
        with self._lock:
            return Samples(
                array("Q", self._times),
                array("I", self._tids),
                array("Q", self._ips),
                self.lost,
                self.dropped,
                self.period_ns,
            )

    def close(self) -> None:
        _DRAINER.remove(self)
        with self._lock:
            self._close_events()

    def _close_events(self) -> None:
        for m in self._maps:
            m.close()
        for fd in self._fds:
            os.close(fd)
        self._maps, self._fds = [], []


def _wrapped(buf: mmap.mmap, at: int, n: int, offset: int, size: int) -> bytes:
    """n bytes of the ring at absolute position `at`, across its end if need be."""
    end = offset + size
    if at >= end:
        at -= size
    if at + n <= end:
        return buf[at : at + n]
    first = end - at
    return buf[at:end] + buf[offset : offset + n - first]


class _Drainer:
    """One daemon thread that drains every live sampler every DRAIN_S."""

    def __init__(self) -> None:
        self._live: set[CpuSampler] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, sampler: CpuSampler) -> None:
        with self._lock:
            self._live.add(sampler)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kiln-sampler-drain", daemon=True)
                self._thread.start()

    def remove(self, sampler: CpuSampler) -> None:
        with self._lock:
            self._live.discard(sampler)

    def _loop(self) -> None:
        while True:
            time.sleep(DRAIN_S)
            with self._lock:
                live = list(self._live)
            for sampler in live:
                try:
                    sampler.drain()
                except (ValueError, OSError):  # closed meanwhile
                    continue


_DRAINER = _Drainer()
