"""Provenance: whose code did the work, judged from evidence the candidate cannot reach.

The reward pays for work the candidate's own build performed. On the cpu backend the evidence is
where the sandbox's threads executed (sampling.py: perf events the verifier owns), sorted by the
one table of attribution.py, over the windows the verifier itself timed around its requests
(`Window`). The rules (`judge_cpu`), each a finding when it holds:

* `aten_work`: during the candidate's calls (a correctness trial's `call`, a timed `trip`), at least
  `MIN_SAMPLES` samples, and `ATEN_SHARE` of the calls' samples, fell in libtorch's operator kernels:
  ATen did work for it, however it was reached (below the dispatcher, through an address the
  candidate computed, through a symbol it interposed).
* `vendor_work`: the same for bundled or external vendor math (MKL, VML, oneDNN, BLAS) while
  `verifier.legality.allow_vendor_libs` is off; with it on, the share is only reported.
* `unknown_code`: the same for executable memory of no file, or of a file nobody expected.
* `plumbing_only`: the calls ran at least `PLUMBING_MIN` samples of libtorch's copies, casts and
  fills and not one of the candidate's own code: no kernel of its own touched the outputs.
* `work_outside_calls`: at least `MIN_SAMPLES` samples of the candidate's own code or of ATen's
  kernels while no call of it ran: while inputs were staged or outputs fetched, during a null trip,
  or between requests (a thread left running, a signal handler, a hook in the allocator). Work
  counts only inside the window it is measured in.

Before the first input (`load`, `build`) the candidate's and ATen's work is allowed (weights are
made then); the compute fence bounds ATen's there (its own rule). The `profile` request (feedback
only) and everything after it are not judged.

Statistical power: a sample every `sampling.PERIOD_NS` of CPU time. A call whose share f of CPU
time is laundered yields, over N samples of calls, about fN laundered samples; `MIN_SAMPLES` = 3
is reached with probability >= 95% once fN >= 6.3 (Poisson). So each verdict states its floor,
min(1, 6.3/N): the smallest laundered share it detects at 95%. An honest candidate's calls have no
sample in ATen's kernels (the fence refuses them at the dispatcher), so the false-positive rate is
that of the attribution table, measured on every shipped solution and honest case (docs/verifier.md).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from actors.verifier.attribution import CLASSES, AddressMap, label
from actors.verifier.legality import Violation
from actors.verifier.sampling import CpuSampler, Samples

MIN_SAMPLES = 3
ATEN_SHARE = 0.01
PLUMBING_MIN = 20
DETECT_95 = 6.3  # Poisson mean at which P(X >= MIN_SAMPLES) = 0.95
TOP = 5  # symbols quoted per class
CALLS = ("call", "trip")  # the windows in which the candidate's calls run
BEFORE_INPUT = ("hello", "prepare", "load", "build")
NOT_JUDGED = ("profile",)


@dataclass(frozen=True)
class Window:
    """One request to the sandbox as the verifier timed it (CLOCK_MONOTONIC ns): `kind` is its op,
    with ":null" for a null trip."""

    kind: str
    start_ns: int
    end_ns: int


@dataclass
class CpuProvenance:
    """What the samples showed: per window kind, samples per class; the top symbols of the classes
    that are not the candidate's; the detection floor; and the findings."""

    available: bool
    why: str = ""
    samples: dict[str, dict[str, int]] = field(default_factory=dict)
    top: dict[str, list[list]] = field(default_factory=dict)
    calls_samples: int = 0
    floor: float = 1.0
    lost: int = 0
    dropped: int = 0
    period_us: float = 0.0
    findings: list[Violation] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "observed": self.available,
            "why": self.why,
            "period_us": self.period_us,
            "samples": self.samples,
            "calls_samples": self.calls_samples,
            "floor": round(self.floor, 4),
            "top": self.top,
            "lost": self.lost,
            "dropped": self.dropped,
            "findings": [v.kind for v in self.findings],
        }


def window_of(windows: list[Window], when: int, loaded_at: int | None, cutoff: int | None) -> str | None:
    """The kind of window a sample time falls in: a request's kind, "idle" between requests once the
    candidate exists, or None when it is not judged (before the candidate was loaded, after the
    profile began)."""
    if cutoff is not None and when >= cutoff:
        return None
    lo, hi = 0, len(windows)
    while lo < hi:  # the last window starting at or before `when`
        mid = (lo + hi) // 2
        if windows[mid].start_ns <= when:
            lo = mid + 1
        else:
            hi = mid
    if lo and windows[lo - 1].start_ns <= when <= windows[lo - 1].end_ns:
        return windows[lo - 1].kind
    return "idle" if loaded_at is not None and when >= loaded_at else None


def judge_cpu(
    sampler: CpuSampler | None, addresses: AddressMap, windows: list[Window], allow_vendor_libs: bool
) -> CpuProvenance:
    """The provenance record of one cpu run, from its sampler and the windows of its requests."""
    if sampler is None or not sampler.available:
        return CpuProvenance(False, sampler.why if sampler else "not sampled")
    return judge_samples(sampler.samples(), addresses, windows, allow_vendor_libs)


def judge_samples(samples: Samples, addresses: AddressMap, windows: list[Window], allow_vendor_libs: bool):
    windows = sorted(windows, key=lambda w: w.start_ns)
    loaded = next((w.end_ns for w in windows if w.kind == "load"), None)
    cutoff = next((w.start_ns for w in windows if w.kind in NOT_JUDGED), None)
    counts: dict[str, Counter] = {}
    symbols: dict[str, Counter] = {c: Counter() for c in CLASSES}
    memo: dict[int, tuple[str, str]] = {}
    for when, ip in zip(samples.times, samples.ips, strict=True):
        kind = window_of(windows, when, loaded, cutoff)
        if kind is None or kind in BEFORE_INPUT:
            continue
        kind = "call" if kind in CALLS else kind
        got = memo.get(ip)
        if got is None:
            a = addresses.attribute(ip)
            got = memo[ip] = (a.cls, label(a.symbol) if a.symbol else a.where)
        counts.setdefault(kind, Counter())[got[0]] += 1
        if kind == "call" and got[0] in ("aten", "vendor", "unknown", "plumbing"):
            symbols[got[0]][got[1]] += 1
    out = CpuProvenance(True)
    out.period_us = samples.period_ns / 1000
    out.lost, out.dropped = samples.lost, samples.dropped
    out.samples = {kind: dict(c) for kind, c in sorted(counts.items())}
    calls = counts.get("call", Counter())
    n = sum(calls.values())
    out.calls_samples = n
    out.floor = min(1.0, DETECT_95 / n) if n else 1.0
    out.top = {cls: [[name[:160], k] for name, k in c.most_common(TOP)] for cls, c in symbols.items() if c}
    out.findings = _findings(counts, n, allow_vendor_libs, out.top)
    return out


def _findings(counts: dict[str, Counter], n: int, allow_vendor_libs: bool, top: dict) -> list[Violation]:
    calls = counts.get("call", Counter())
    found = []

    def share(cls: str) -> bool:
        return calls[cls] >= MIN_SAMPLES and calls[cls] >= ATEN_SHARE * n

    def named(cls: str) -> str:
        names = [name for name, _ in top.get(cls, [])[:2]]
        return f" (e.g. {', '.join(names)})" if names else ""

    if share("aten"):
        found.append(
            Violation(
                "aten_work",
                f"{calls['aten']} of {n} samples of your calls ran in libtorch's operator kernels{named('aten')}",
                "",
                "ATen's compute reached below the dispatcher: write the computation in your own kernel",
            )
        )
    if share("vendor") and not allow_vendor_libs:
        found.append(
            Violation(
                "vendor_work",
                f"{calls['vendor']} of {n} samples of your calls ran in vendor math{named('vendor')}",
                "",
                "vendor libraries are switched off (verifier.legality.allow_vendor_libs)",
            )
        )
    if share("unknown"):
        found.append(
            Violation(
                "unknown_code",
                f"{calls['unknown']} of {n} samples of your calls ran in code of no known library{named('unknown')}",
                "",
                "only your own build's code, the runtime and (where allowed) vendor libraries may compute",
            )
        )
    if n and calls["own"] == 0 and calls["plumbing"] >= PLUMBING_MIN:
        found.append(
            Violation(
                "plumbing_only",
                f"none of {n} samples of your calls ran your own code; {calls['plumbing']} ran libtorch's "
                "copies, casts or fills",
                "",
                "plumbing alone (a copy, a cast, a fill) is not an answer: compute in your own kernel",
            )
        )
    outside = {kind: _outside_work(c) for kind, c in counts.items() if kind != "call"}
    if sum(outside.values()) >= MIN_SAMPLES:
        where = ", ".join(f"{kind} {k}" for kind, k in outside.items() if k)
        found.append(
            Violation(
                "work_outside_calls",
                f"{sum(outside.values())} samples of compute while none of your calls ran ({where})",
                "",
                "work done outside forward (staging, a thread left running, a handler) escapes the clock",
            )
        )
    return found


def _outside_work(c: Counter) -> int:
    """Samples of work in a window where no call of the candidate's runs: its own code and unknown
    code always count; ATen's kernels count at the share that counts in a call (the sandbox's own
    staging copies run there, and a rare misattributed sample of them must not read as work)."""
    total = sum(c.values())
    aten = c["aten"] if c["aten"] >= MIN_SAMPLES and c["aten"] >= ATEN_SHARE * total else 0
    return c["own"] + c["unknown"] + aten


# ------------------------------------------------------------------------------------- cuda
#
# On cuda the evidence is the device's own record of what ran (CUPTI's activity records, switched on
# in the sandbox around each traced request: sealed._tracing, device_trace.py), taken around every
# request after the candidate's ModelNew exists but the timed trips, each kernel named. A kernel is the candidate's own when its name is one of the
# functions of the device code the verifier read from the candidate's built libraries (cubins.py).
# The others are sorted by name:
#   plumbing  copies and memsets, and libtorch's copy, cast, fill and random-fill kernels (the
#             sandbox's own staging and snapshots among them, and its input delay, `spin_kernel`)
#   vendor    cuBLAS/cuBLASLt (CUTLASS and nvjet kernels included), cuDNN, cuFFT, cuSPARSE, cuRAND
#   aten      any other kernel of libtorch's (at::, c10::, torch's anonymous namespaces)
#   unknown   a kernel none of the above names
# Every traced request runs kernels of the sandbox's own (its staging copies, the input delay, the
# flushes): a trace that recorded none of them was switched off (`trace_missing`).
CUDA_PLUMBING = re.compile(
    r"^(Memcpy|Memset)|FillFunctor|copy_kernel|copy_device_to_device|distribution_elementwise|normal_and_transform"
    r"|uniform_and_transform|bernoulli_tensor|randperm|spin_kernel|elementwise_kernel_with_index<.*arange"
)
CUDA_VENDOR = re.compile(
    r"cublas|cutlass|xmma|nvjet|cudnn|cufft|cusparse|curand|gemv|gemmSN|gemmk|splitKreduce|\bsm\d+_|ampere_|hopper_"
    r"|volta_|turing_|blackwell_|fft\w*_kernel|regular_fft|vector_fft"
)
CUDA_ATEN = re.compile(r"\bat::|\bc10::|\(anonymous namespace\)::|\bcunn_|\btorch::")


def classify_kernel(name: str, own: frozenset[str]) -> str:
    if name in own:
        return "own"
    if CUDA_PLUMBING.search(name):
        return "plumbing"
    if CUDA_ATEN.search(name) and "at::native" in name or name.startswith(("void at::", "at::")):
        return "aten"
    if CUDA_VENDOR.search(name):
        return "vendor"
    if CUDA_ATEN.search(name):
        return "aten"
    return "unknown"


@dataclass(frozen=True)
class Traced:
    """One traced request: its kind, the calls it made (1 for a correctness `call`, K for a `trip`,
    0 where the candidate's forward is not called), the kernels that ran: [name, count], and how many
    records the trace lost (its buffers ran out: the record is incomplete)."""

    kind: str
    calls: int
    kernels: list
    lost: int = 0


@dataclass
class CudaProvenance:
    available: bool
    why: str = ""
    own_kernels: int = 0  # kernels the candidate's build defines
    unreadable: int = 0  # device code entries of its build the verifier could not read
    launches: dict[str, dict[str, int]] = field(default_factory=dict)  # window kind -> class -> launches
    top: dict[str, list[list]] = field(default_factory=dict)
    audited_trips: int = 0
    findings: list[Violation] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "observed": self.available,
            "why": self.why,
            "own_kernels": self.own_kernels,
            "unreadable": self.unreadable,
            "launches": self.launches,
            "top": self.top,
            "audited_trips": self.audited_trips,
            "findings": [v.kind for v in self.findings],
        }


def judge_cuda(traced: list[Traced], own: frozenset[str], unreadable: int, allow_vendor_libs: bool) -> CudaProvenance:
    """The provenance record of one cuda run from its traced requests."""
    out = CudaProvenance(True, own_kernels=len(own), unreadable=unreadable)
    if not traced:
        out.available, out.why = False, "no request was traced"
        return out
    names: dict[str, Counter] = {c: Counter() for c in CLASSES}
    short_calls, blank, lost = 0, 0, 0
    for t in traced:
        if not t.kernels:  # the sandbox's own copies, fills or flushes run in every traced request
            blank += 1
        lost += t.lost
        by_class: Counter = Counter()
        for entry in t.kernels:
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str or type(entry[1]) is not int:
                continue
            cls = classify_kernel(entry[0], own)
            by_class[cls] += entry[1]
            if cls != "own":
                names[cls][entry[0]] += entry[1]
        window = out.launches.setdefault(t.kind, {})
        for cls, k in by_class.items():
            window[cls] = window.get(cls, 0) + k
        if t.calls:
            working = by_class["own"] + (by_class["vendor"] if allow_vendor_libs else 0)
            short_calls += max(0, t.calls - working)
        if t.kind == "trip":
            out.audited_trips += 1
    out.top = {cls: [[n[:160], k] for n, k in c.most_common(TOP)] for cls, c in names.items() if c}
    out.findings = _cuda_findings(out.launches, short_calls, allow_vendor_libs, out.top)
    if blank:
        out.findings.append(
            Violation(
                "trace_missing",
                f"{blank} traced requests recorded nothing, not even the sandbox's own copies",
                "",
                "the device's record of what ran was switched off or tampered with",
            )
        )
    if lost:
        out.findings.append(
            Violation(
                "trace_missing",
                f"the device's record lost {lost} records of your calls (over 65,536 launches in one request)",
                "",
                "launch fewer kernels per call: a record the verifier cannot read in full pays nothing",
            )
        )
    return out


def _cuda_findings(launches: dict, short_calls: int, allow_vendor_libs: bool, top: dict) -> list[Violation]:
    found = []
    calls = Counter()
    for kind in CALLS:
        calls.update(launches.get(kind, {}))

    def named(cls: str) -> str:
        picked = [n for n, _ in top.get(cls, [])[:2]]
        return f": {'; '.join(picked)}" if picked else ""

    if calls["aten"]:
        found.append(
            Violation(
                "aten_work",
                f"{calls['aten']} launches of libtorch's kernels in your calls{named('aten')}",
                "",
                "a kernel of PyTorch's (replayed from a graph, or reached below the dispatcher) did the work: "
                "write the computation in your own kernel",
            )
        )
    if calls["unknown"]:
        found.append(
            Violation(
                "unknown_code",
                f"{calls['unknown']} launches of kernels your build does not define{named('unknown')}",
                "",
                "only kernels compiled from your own sources (and, where allowed, vendor libraries) may compute",
            )
        )
    if calls["vendor"] and not allow_vendor_libs:
        found.append(
            Violation(
                "vendor_work",
                f"{calls['vendor']} launches of vendor kernels in your calls{named('vendor')}",
                "",
                "vendor libraries are switched off (verifier.legality.allow_vendor_libs)",
            )
        )
    if short_calls:
        found.append(
            Violation(
                "plumbing_only",
                f"{short_calls} of your calls launched no kernel of your own",
                "",
                "plumbing alone (a copy, a cast, a fill) is not an answer: compute in your own kernel",
            )
        )
    outside = Counter()
    for kind, counts in launches.items():
        if kind not in CALLS:
            outside.update({k: v for k, v in counts.items() if k in ("own", "aten", "unknown")})
    if sum(outside.values()):
        found.append(
            Violation(
                "work_outside_calls",
                f"{sum(outside.values())} kernels ran while none of your calls did ("
                + ", ".join(f"{k} {v}" for k, v in outside.items())
                + ")",
                "",
                "work done outside forward (staging, a thread left running, a handler) escapes the clock",
            )
        )
    return found
