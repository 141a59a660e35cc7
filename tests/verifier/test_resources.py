"""The verifier's own resources against candidates that try to exhaust them, and out-of-memory
verdicts decided by evidence (docs/verifier.md, P6 and P14).

Every read of something a candidate wrote is bounded before it allocates, every stored field is
capped, the build cache is bounded, and a device out-of-memory is the candidate's or the machine's by
the driver's figure of what its sandbox held, never by what the sandbox says. The memory tests
measure the growth of this process's peak resident memory (VmHWM, reset through
/proc/self/clear_refs) over what it held before, against a stated bound. Each test names the
mutation that reopens the hole it guards.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.verifier import gpumem, limits
from actors.verifier.build import cache as build_cache
from actors.verifier.build.symbols import Allowlist, check_library
from actors.verifier.build.watch import log_tail
from actors.verifier.outcome import RunOutcome
from actors.verifier.suite import load_suite
from actors.verifier.verifier import KernelVerifier
from tests.verifier.integrity import config, verify

MiB = 1 << 20
GiB = 1 << 30
SUITE = {c.name: c for c in load_suite("cpu")}
# The most this process's peak resident memory may rise while one flooding candidate is handled: a
# message in flight (8 MB on the wire, as much decoded) and what is kept of it, with room for the
# interpreter's own noise. Each attack below costs hundreds of MB to GB without its bound.
GROWTH_BOUND = 96 * MiB


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_growth(fn):
    """(fn(), how far the peak resident memory rose above the resident memory before it)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = _status("VmRSS")
    out = fn()
    return out, _status("VmHWM") - before


def fresh(case: str) -> str:
    return SUITE[case].source() + f"\n# {uuid.uuid4().hex}\n"


@pytest.fixture(scope="module")
def verifier(verifier_cache_dir):
    v = KernelVerifier(config(verifier_cache_dir))
    v.builds.extensions.allowlist.torch.load()  # torch's exports, read once at start-up: not part of what is measured
    yield v
    v.close()


# ------------------------------------------------------------------ what a capture process sends


def test_a_capture_log_is_read_from_its_end(verifier):
    """Module-level code writes a gigabyte to stderr and aborts: the service reads the log's last
    1,500 bytes for the crash's frames, and the log itself stops at the jail's file-size limit.
    Reopened by: reading the whole file in build/watch.read_tail (`path.read_text()[-n:]`, as
    build/results._tail did): +2 GB here."""
    result, growth = peak_growth(lambda: verifier.builds.submit(fresh("capture_log_flood")).result())
    assert result.error_class == "runtime" and "crashed the process" in result.error, result.error
    assert growth < GROWTH_BOUND, f"the verifier grew by {growth >> 20} MB"


def test_a_log_of_a_gigabyte_costs_its_tail(tmp_path):
    """A compiler's (or any jailed process's) log of 1 GB (sparse here) is read from its end.
    Reopened by: `path.read_text()` in build/watch.read_tail."""
    log = tmp_path / "build.log"
    with open(log, "wb") as f:
        f.truncate(1 << 30)
        f.seek(-5, os.SEEK_END)
        f.write(b"tail\n")
    text, growth = peak_growth(lambda: log_tail(log))
    assert text.endswith("tail") and len(text) <= 802
    assert growth < 16 * MiB, f"{growth >> 20} MB"


def test_a_capture_process_that_floods_its_channel_is_stopped(verifier):
    """Module-level code writes 200 messages of 8 MB onto its socket (the channel object is not
    reachable, the descriptor is): the service keeps the first of each kind, cut, and stops the
    process past 64 MB. Reopened by: removing the MAX_CAPTURE_BYTES check in build/service._converse
    (and the one-of-each-kind rule): every message is kept, 1.6 GB."""
    result, growth = peak_growth(lambda: verifier.builds.submit(fresh("capture_message_flood")).result())
    assert result.error_class == "runtime" and "sent the build service more than" in result.error, result.error
    assert growth < GROWTH_BOUND, f"the verifier grew by {growth >> 20} MB"


def test_a_message_that_would_decode_to_millions_of_objects_is_refused():
    """A megabyte of empty arrays decodes to 64 MB of Python objects: the channel counts them from
    the type bytes first. Reopened by: skipping wire.count_items in wire.recv_counted."""
    import socket

    import msgpack

    from actors.verifier import wire

    body = msgpack.packb([[]] * (1 << 20))
    a, b = socket.socketpair()
    sender = threading.Thread(target=b.sendall, args=(len(body).to_bytes(4, "little") + body,), daemon=True)
    sender.start()
    try:
        with pytest.raises(wire.WireError, match="objects"):
            wire.recv_counted(a, time.monotonic() + 30, max_bytes=8 << 20)
    finally:
        sender.join(timeout=30)
        a.close()
        b.close()


def test_error_text_is_capped_in_the_verdict_and_both_caches(verifier, verifier_cache_dir, relu_task):
    """A 7 MB "unsupported call" text forged onto the compile stage's socket: what the service keeps
    of it, the capture cache's record and the verdict (and so its cache entry) are bounded.
    Reopened by: removing the cut in build/service._kept (the capture cache's record is then 7 MB);
    the verdict's own bound by removing the cut in redact.diagnostics."""
    r, growth = peak_growth(lambda: verify(verifier, relu_task, fresh("giant_error_text")))
    assert r.error_class == "compile" and "kiln giant text" in r.feedback
    assert len(r.feedback) <= 4000  # redact.MAX_FEEDBACK
    assert len(json.dumps(r.diagnostics)) <= 256 << 10  # redact.MAX_DIAGNOSTICS
    assert len(r.diagnostics["error"]) <= 2000  # redact.MAX_STRING
    record = _newest((verifier.builds.cache.root / "captures").glob("*.json"))
    assert "kiln giant text" in record.read_text() and record.stat().st_size < 64 << 10
    entry = _newest((Path(verifier_cache_dir) / "verdicts").rglob("*.bin"))
    assert entry.stat().st_size < 256 << 10
    assert growth < GROWTH_BOUND, f"the verifier grew by {growth >> 20} MB"


def _newest(paths) -> Path:
    return max(paths, key=lambda p: p.stat().st_mtime)


# ------------------------------------------------------------------------------ built libraries


def _elf(path: Path, symbols: int, name_bytes: int) -> None:
    """A minimal 64-bit ELF file: a dynamic symbol table of `symbols` undefined entries, every one
    named by the same string of `name_bytes` characters."""
    strtab = b"\0" + b"s" * name_bytes + b"\0"
    dynsym = bytes(24) + struct.pack("<IBBHQQ", 1, 0x12, 0, 0, 0, 0) * symbols
    off_sym = 64
    off_str = off_sym + len(dynsym)
    off_sh = off_str + len(strtab)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, off_sh)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 0)
    sections = bytes(64)
    sections += struct.pack("<IIQQQQIIQQ", 0, 11, 0, 0, off_sym, len(dynsym), 2, 0, 8, 24)
    sections += struct.pack("<IIQQQQIIQQ", 0, 3, 0, 0, off_str, len(strtab), 0, 0, 1, 0)
    path.write_bytes(bytes(header) + dynsym + strtab + sections)


@pytest.mark.parametrize(
    ("symbols", "name_bytes", "words"),
    [(200_000, 8, "dynamic symbols"), (90_000, 3_000, "symbol names exceed")],
    ids=["many-symbols", "long-names"],
)
def test_a_library_with_too_many_symbols_is_refused_before_it_is_read(tmp_path, symbols, name_bytes, words):
    """The symbol check reads a candidate's library section by section, within bounds on its symbols
    and their names, and refuses one past them as unreadable (a finding). Reopened by: dropping
    `limited=True` in symbols.check_library (the whole file is read and every name decoded: 200,000
    symbols, or 90,000 names of 3 KB = 270 MB)."""
    lib = tmp_path / "many.so"
    _elf(lib, symbols, name_bytes)
    found, growth = peak_growth(lambda: check_library(str(lib), Allowlist([]), ()))
    assert found.violations and words in found.violations[0].what, found.violations
    assert growth < 48 * MiB, f"{growth >> 20} MB"


# --------------------------------------------------------------------------------- the cache


def _entry(cache: build_cache.ArtifactCache, key: str, nbytes: int, used: float) -> Path:
    d = cache.root / "ext" / key
    d.mkdir(parents=True)
    (d / "m.so").write_bytes(b"\0" * nbytes)
    (d / "meta.json").write_text(json.dumps({"module": "m.so"}))
    os.utime(d / "meta.json", (used, used))
    return d


def test_the_build_cache_is_bounded_least_recently_used_first_and_never_in_use(tmp_path):
    """Past its bound the cache drops entries least recently used first (a hit is a use), and never
    one in use: a pin (a shared flock, here taken by another process) keeps it. Reopened by:
    removing the exclusive flock test in build/cache.ArtifactCache._remove (the pinned entry goes)."""
    import subprocess
    import sys

    cache = build_cache.ArtifactCache(tmp_path, "tc")
    old, pinned, hit, new = (_entry(cache, k, MiB, t) for k, t in (("old", 1), ("pinned", 2), ("hit", 3), ("new", 4)))
    assert cache.lookup("hit") is not None  # a use: now the most recent
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({str(cache.root / 'locks' / 'pinned.use')!r}, os.O_RDONLY | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = cache.trim(2 * MiB + 4096)
    finally:
        holder.kill()
        holder.wait()
    assert removed == ["old", "new"], removed
    assert pinned.is_dir() and hit.is_dir() and not old.exists() and not new.exists()
    assert cache.size() <= 2 * MiB + 4096


def test_the_build_service_trims_its_cache_after_every_job(verifier, tmp_path):
    """A job ends with the cache back under its bound. Reopened by: removing the `trim` call at the
    end of build/service._job."""
    cache = verifier.builds.cache
    bound = verifier.builds.cache_bytes
    stale = _entry(cache, f"stale-{uuid.uuid4().hex[:8]}", MiB, 1)
    try:
        verifier.builds.cache_bytes = cache.size() - 1  # one byte over: the stalest entry goes
        verifier.builds.submit("import torch\nimport torch.nn as nn\n" + f"# {uuid.uuid4().hex}\n").result()
        assert not stale.exists()
    finally:
        verifier.builds.cache_bytes = bound


# ------------------------------------------------------------------ out of memory, by evidence


def test_a_trusted_oom_is_the_candidates_only_when_its_sandbox_held_more_than_its_share():
    """The verifier's own draw, reference run or baseline running out of device memory while a
    sandbox is alive: runtime (-1) when the driver says the sandbox held more than its share, infra
    (0) otherwise or when no figure could be taken. Reopened by: returning "infra" unconditionally
    in gpumem.trusted_oom (the code before: every such OOM was infra)."""
    from actors.verifier import gpumem

    share = gpumem.share(reserved_bytes=GiB, param_bytes=MiB)
    assert share == GiB + 2 * MiB + gpumem.CONTEXT_BYTES
    hog = gpumem.Evidence(held=120 * GiB, share=share, how="the driver's per-process figure")
    assert gpumem.trusted_oom(hog)[0] == "runtime" and "more than its share" in gpumem.trusted_oom(hog)[1]
    assert gpumem.trusted_oom(gpumem.Evidence(held=share, share=share, how="x"))[0] == "infra"
    assert gpumem.trusted_oom(gpumem.Evidence(held=None, share=share, how="no figure"))[0] == "infra"


def test_a_sandboxs_own_oom_is_the_machines_only_on_the_drivers_word():
    """The candidate's code reports "CUDA out of memory": infra only when the driver says the device
    could not give the sandbox its share (what it held plus what was free falls short: an innocent
    sandbox sharing the GPU with a hog gets 0, not -1); otherwise runtime, whatever the text says
    (it asked beyond its share, or no figure). Reopened by: dropping the `crowded` condition in
    gpumem.sandbox_oom (a candidate that raises a forged OOM on an idle device would get 0)."""
    from actors.verifier import gpumem

    share = gpumem.share(GiB, 0)  # 3 GiB
    crowded = {"free": 512 * MiB, "total": 140 * GiB}
    idle = {"free": 130 * GiB, "total": 140 * GiB}
    assert gpumem.sandbox_oom(gpumem.Evidence(held=GiB, share=share, how="d", **crowded))[0] == "infra"
    assert gpumem.sandbox_oom(gpumem.Evidence(held=GiB, share=share, how="d", **idle))[0] == "runtime"
    assert gpumem.sandbox_oom(gpumem.Evidence(held=100 * GiB, share=share, how="d", **crowded))[0] == "runtime"
    assert gpumem.sandbox_oom(gpumem.Evidence(held=None, share=share, how="d", **crowded))[0] == "runtime"


def _verdicts(monkeypatch, held: int | None, message: str = "", error_class: str | None = None):
    """A run's outcome and its DeviceVerdicts on cuda (no device touched), fed with evidence `held`."""
    from actors.verifier import gpumem
    from actors.verifier.device_verdicts import DeviceVerdicts

    out = RunOutcome(stage="correctness", error_class=error_class, message=message)
    seen = {}

    def take(child, device, uuid_, share, *, may_kill):
        seen["may_kill"] = may_kill
        return gpumem.Evidence(held=held, share=share, how="the driver's per-process figure", free=0, total=140 * GiB)

    monkeypatch.setattr(gpumem, "take", take)
    return out, DeviceVerdicts("cuda:0", "GPU-test", gpumem.share(GiB, 0)), seen


def test_the_run_decides_a_device_oom_by_evidence(monkeypatch):
    """The verifier's own OOM (reference.DeviceFull) becomes runtime or infra by the evidence, taken
    while the sandbox is alive (it may be killed to measure what it held: the run ends there); and the
    sandbox's own reported OOM becomes infra only on that evidence (device_verdicts.py). Reopened by:
    removing the DeviceFull handler in runner._run_in (the error then reaches the run's `except
    ReferenceError`: infra)."""
    from actors.verifier.reference import DeviceFull

    child = SimpleNamespace(alive=True)
    doing = "trial 2 (the task's default shapes)"
    out, device, seen = _verdicts(monkeypatch, held=100 * GiB)
    device.verifier_oom(out, child, DeviceFull("the inputs of t do not fit in device memory"), doing)
    assert out.error_class == "runtime" and seen["may_kill"] is True
    assert out.limits["device_memory"]["held_mb"] == 100 * 1024
    out, device, _ = _verdicts(monkeypatch, held=GiB)
    device.verifier_oom(out, child, DeviceFull("x"), doing)
    assert out.error_class == "infra" and f"while {doing}" in out.message
    said = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB while forward on trial 1"
    out, device, seen = _verdicts(monkeypatch, held=GiB, message=said, error_class="runtime")
    device.candidate_oom(out, child)
    assert out.error_class == "infra" and seen["may_kill"] is True
    out, device, _ = _verdicts(monkeypatch, held=100 * GiB, message=said, error_class="runtime")
    device.candidate_oom(out, child)
    assert out.error_class == "runtime"


class _DriverStandIn:
    """libnvidia-ml's calls the device watch makes, answering with figures the test sets."""

    def __init__(self):
        self.procs: list[tuple[int, int]] = []
        self.free, self.total = 100 * GiB, 140 * GiB

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid_, handle):
        self.asked = uuid_
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, memory):
        info = ctypes.cast(memory, ctypes.POINTER(gpumem._MemoryInfo)).contents
        info.total, info.free, info.used = self.total, self.free, self.total - self.free
        return 0

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count, buf):
        n = ctypes.cast(count, ctypes.POINTER(ctypes.c_uint))
        if n.contents.value < len(self.procs):
            n.contents.value = len(self.procs)
            return 7
        for i, (pid, used) in enumerate(self.procs):
            buf[i].pid, buf[i].usedGpuMemory = pid, used
        n.contents.value = len(self.procs)
        return 0


def test_the_device_watch_stops_a_sandbox_that_fills_the_device_and_spares_the_others():
    """A sandbox whose processes (a child of it included, found up the process tree) hold more than
    its share while the device is nearly full is killed, and its overrun recorded with the driver's
    figures; one over its share on a device with room, and one within its share, are left alone;
    an overrun is another run's window, not the filler's own. Reopened by: `or` for `and` in
    gpumem.overran (a kernel over its share on an idle device would be killed: a false -1),
    OVERRUN_FACTOR = 1 (one a little over its estimated share on a full device would be), or
    attributing only the sandbox's own pid (a filler's child process would go unseen)."""
    import subprocess
    import sys

    from actors.verifier import gpumem

    driver = _DriverStandIn()
    watch = gpumem.DeviceWatch(gpumem.Nvml(driver), "GPU-test", poll_s=3600)  # looks only when told
    procs = []
    try:
        spawn = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
        filler = subprocess.Popen([sys.executable, "-c", f"{spawn}; time.sleep(60)"])
        procs.append(filler)
        deadline = time.monotonic() + 10
        while not (grandchild := _children(filler.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert grandchild, "the stand-in sandbox's child did not start"
        killed = []
        sessions = {
            name: SimpleNamespace(sandbox_pid=pid, kill=lambda name=name: killed.append(name))
            for name, pid in (("filler", filler.pid), ("innocent", os.getpid()))
        }
        hog = watch.watch(sessions["filler"], share_bytes=3 * GiB)
        calm = watch.watch(sessions["innocent"], share_bytes=3 * GiB)
        # over its share with room to spare: harmless, nobody is stopped
        driver.procs = [(grandchild[0], 10 * GiB), (os.getpid(), GiB)]
        watch.look()
        assert killed == [] and hog.overrun is None
        # the device nearly full, the filler's child holding it: the filler is stopped; the other, over
        # its share but within twice it (the share is an estimate), is not
        driver.procs = [(filler.pid, GiB), (grandchild[0], 130 * GiB), (os.getpid(), 5 * GiB)]
        driver.free = 300 * MiB
        watch.look()
        assert killed == ["filler"] and calm.overrun is None
        assert hog.overrun.held == 131 * GiB and hog.overrun.free == 300 * MiB
        assert "stopped for filling the device" in gpumem.overrun_message(hog.overrun)
        assert [o.held for o in watch.overruns_since(calm.since, exclude=calm)] == [131 * GiB]
        assert watch.overruns_since(hog.since, exclude=hog) == []  # its own overrun is no excuse
        watch.unwatch(hog)
        watch.unwatch(calm)
    finally:
        for p in procs:
            for c in _children(p.pid):
                os.kill(c, 9)
            p.kill()
            p.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def test_an_oom_during_another_sandboxs_overrun_is_the_machines_and_the_filler_gets_its_minus_one():
    """The run's verdict after the device watch: the stopped filler gets runtime with the driver's
    figures (not the crash its kill caused); an innocent run whose own out-of-memory fell in the
    filler's window gets infra; an innocent run's wrong answer stays its own. Reopened by: dropping
    the out-of-memory condition in DeviceVerdicts.watch_word (a wrong answer in another's window
    would get 0, not its -1), or its overrun branch (the filler's kill would read as a crash)."""
    from actors.verifier import gpumem
    from actors.verifier.device_verdicts import DeviceVerdicts

    driver = _DriverStandIn()
    watch = gpumem.DeviceWatch(gpumem.Nvml(driver), "GPU-judge", poll_s=3600)

    def run_for(session, error_class, message):
        return RunOutcome(stage="run", error_class=error_class, message=message), watch.watch(
            session, share_bytes=3 * GiB
        )

    filler = SimpleNamespace(sandbox_pid=os.getpid(), kill=lambda: None)
    innocent = SimpleNamespace(sandbox_pid=os.getppid(), kill=lambda: None)
    bystander = SimpleNamespace(sandbox_pid=1, kill=lambda: None)
    hog = run_for(filler, "runtime", "while trial 1, the sandbox child is gone")
    oom = run_for(innocent, "runtime", "RuntimeError: CUDA error: out of memory while a timed run")
    wrong = run_for(bystander, "correctness", "the output: 3 of 4 elements outside tolerance")
    driver.procs, driver.free = [(os.getpid(), 120 * GiB)], 100 * MiB
    watch.look()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpumem, "device_watch", lambda uuid_: watch)
        for out, watched in (hog, oom, wrong):
            DeviceVerdicts("cuda:0", "GPU-judge", 3 * GiB).watch_word(out, watched)
    hog, oom, wrong = hog[0], oom[0], wrong[0]
    assert hog.error_class == "runtime" and "stopped for filling the device" in hog.message
    assert hog.limits["device_memory"]["held_mb"] == 120 * 1024
    assert oom.error_class == "infra" and "crowded this run out" in oom.message
    assert wrong.error_class == "correctness"


def test_the_drivers_per_process_figure_counts_only_the_sandboxs_processes():
    """NVML's per-process list, read through a stand-in for libnvidia-ml: the figure is the sum over
    the sandbox's pids, None when the driver names none of them (a PID namespace it does not see),
    and a list longer than the first buffer is asked for again. Reopened by: summing every process
    in gpumem.Nvml.process_bytes."""
    from actors.verifier import gpumem

    driver = _DriverStandIn()
    driver.procs = [(1000 + i, MiB) for i in range(100)] + [(42, 3 * GiB), (43, GiB)]
    nvml = gpumem.Nvml(driver)
    assert nvml.process_bytes("abc", {42, 43}) == 4 * GiB
    assert driver.asked == b"GPU-abc"  # the UUID as NVML spells it
    assert nvml.process_bytes("abc", {7}) is None


def test_a_memory_death_under_a_capped_limit_is_the_machines_only_below_what_any_candidate_needs():
    """A machine that caps the sandbox below the task's planned need still decides nothing by
    itself: a memory death is infra only where the cap is below the least any candidate holds (the
    process, its inputs and outputs, one copy of its weights); above that, a candidate that filled
    its memory gets runtime. Reopened by: passing `capped` instead of `starved` to the sandbox in
    runner.CandidateRun.run (every death under a capped limit was infra)."""
    roomy = limits.derive("cpu", 256, 60.0, 3 * GiB, 6, 4 * GiB, machine_bytes=16 * GiB)
    assert roomy.capped and not roomy.starved and roomy.to_json()["starved"] is False
    tight = limits.derive("cpu", 256, 60.0, 8 * GiB, 6, 16 * GiB, machine_bytes=16 * GiB)
    assert tight.capped and tight.starved
