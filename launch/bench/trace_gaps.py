"""Where a profiled step's GPU sat idle, and what the host was doing meanwhile: read from torch.profiler's
chrome trace, for `launch.bench.gpu_megatron --profile`.

A kernel table says what the GPU ran; it cannot say why the GPU ran nothing for part of the step.
On two H100s the SFT step's kernels added up to about 169 ms of a 209 ms step, and the 40 ms left
over belonged to no kernel. Those are the gaps this module reads:

- **Phases.** The learner marks its step's parts with `torch.profiler.record_function` ranges named
  `kiln.*` (pack, forward_backward, grad_reduce, optimizer; see the megatron backend). For each phase:
  its wall time, the time the GPU was busy inside it (any stream), and the rest, idle.
- **Work by phase.** Each phase's device work by kernel, counted in the phase that launched it (the
  phase open on the learner's thread at the launch; backward launches from autograd's own thread, so
  the time decides, not the thread). A collective's time includes waiting for the other ranks.
- **Gaps.** Each stretch of at least `min_gap_us` with nothing running on the device. The kernel that
  ends a gap was launched by a runtime call (the trace links the two by correlation id):
  - launched after the gap began: the GPU waited for the host. The gap names what the host was doing
    when the device ran dry, and what launched the next work (the innermost host ops on the
    launching thread at each moment).
  - launched before the gap began: the work was queued but held back (an event wait on another
    stream, or a collective waiting for another rank).

Everything here is plain data in, plain data out: `Trace.from_events` takes the trace's event list.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # work on the device, any stream
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver"})  # the host's launch (and sync) calls
HOST_CATS = frozenset({"cpu_op", "user_annotation", "python_function"})  # the host's call tree
PHASE_PREFIX = "kiln."  # record_function names that mark a step's phases


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # µs, the trace's clock
    end: float
    thread: int | str = 0
    correlation: int | None = None  # device work and runtime calls: the launch that goes with it


@dataclass(frozen=True)
class Phase:
    name: str
    wall_us: float
    busy_us: float  # the device ran something, on any stream, inside the phase

    @property
    def idle_us(self) -> float:
        return self.wall_us - self.busy_us


@dataclass(frozen=True)
class Gap:
    start: float  # µs, the trace's clock
    end: float
    phase: str  # the phase open on the host when the gap began ("-" outside every phase)
    host_bound: bool  # the work ending the gap was launched after the gap began
    launched_us: float | None  # when, relative to the gap's start (None: no launch found)
    dry: tuple[str, ...]  # the host's innermost ops when the device ran dry (outermost first)
    launcher: tuple[str, ...]  # the host's innermost ops at the launch of the work ending the gap
    next_work: str  # the device work that ended the gap

    @property
    def us(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    device: list[Span]  # sorted by start
    runtime: dict[int, Span]  # correlation id -> the runtime call that launched that work
    host: dict[int | str, list[Span]]  # thread -> its host spans, sorted by start

    @classmethod
    def from_events(cls, events: list[dict]) -> Trace:
        device, runtime, host = [], {}, {}
        for e in events:
            if e.get("ph") != "X" or "ts" not in e or "dur" not in e:
                continue
            cat, args = e.get("cat"), e.get("args") or {}
            corr = args.get("correlation")
            span = Span(
                str(e.get("name", "?")), float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("tid", 0), corr
            )
            if cat in DEVICE_CATS:
                device.append(span)
            elif cat in RUNTIME_CATS and corr is not None:
                runtime[corr] = span
            elif cat in HOST_CATS:
                host.setdefault(span.thread, []).append(span)
        device.sort(key=lambda s: s.start)
        for spans in host.values():
            spans.sort(key=lambda s: (s.start, -s.end))
        return cls(device, runtime, host)

    @classmethod
    def read(cls, path: Path) -> Trace:
        return cls.from_events(json.loads(Path(path).read_text())["traceEvents"])

    def busy(self) -> list[tuple[float, float]]:
        """The device's busy intervals, every stream merged."""
        merged: list[list[float]] = []
        for s in self.device:
            if merged and s.start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], s.end)
            else:
                merged.append([s.start, s.end])
        return [(a, b) for a, b in merged]

    def stack(self, thread: int | str, t: float) -> list[Span]:
        """The host spans open on `thread` at time `t`, outermost first."""
        return [s for s in self.host.get(thread, []) if s.start <= t < s.end]

    def main_thread(self) -> int | str | None:
        """The thread that holds the phases (else the one with the most host time)."""
        for thread, spans in self.host.items():
            if any(s.name.startswith(PHASE_PREFIX) for s in spans):
                return thread
        if not self.host:
            return None
        return max(self.host, key=lambda t: sum(s.end - s.start for s in self.host[t]))


def busy_within(busy: list[tuple[float, float]], a: float, b: float) -> float:
    """Time of the merged intervals `busy` inside [a, b)."""
    i = max(bisect.bisect_left(busy, (a, a)) - 1, 0)
    total = 0.0
    for lo, hi in busy[i:]:
        if lo >= b:
            break
        total += max(0.0, min(hi, b) - max(lo, a))
    return total


def phases(trace: Trace) -> list[Phase]:
    """Each `kiln.*` range in the order it ran, with the device's busy time inside it."""
    busy = trace.busy()
    found = [s for spans in trace.host.values() for s in spans if s.name.startswith(PHASE_PREFIX)]
    return [
        Phase(s.name, s.end - s.start, busy_within(busy, s.start, s.end)) for s in sorted(found, key=lambda s: s.start)
    ]


@dataclass(frozen=True)
class Work:
    name: str  # a kernel, memcpy or memset
    calls: int
    us: float  # their summed device time


def phase_work(trace: Trace) -> dict[str, list[Work]]:
    """For each phase name (repeats summed, in the order they first ran), its device work by name,
    longest first; work launched outside every phase is left out. Phases do not nest."""
    main = trace.main_thread()
    ranges = sorted((s.start, s.end, s.name) for s in trace.host.get(main, []) if s.name.startswith(PHASE_PREFIX))
    starts = [r[0] for r in ranges]
    found: dict[str, dict[str, list[float]]] = {name: {} for _, _, name in ranges}
    for work in trace.device:
        launch = trace.runtime.get(work.correlation) if work.correlation is not None else None
        t = launch.start if launch is not None else work.start
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t >= ranges[i][1]:
            continue
        total = found[ranges[i][2]].setdefault(work.name, [0, 0.0])
        total[0] += 1
        total[1] += work.end - work.start
    return {
        phase: sorted((Work(name, int(c), us) for name, (c, us) in works.items()), key=lambda w: -w.us)
        for phase, works in found.items()
    }


def gaps(trace: Trace, min_gap_us: float = 100.0) -> list[Gap]:
    """The device's idle stretches of at least `min_gap_us` between its first and last work, with
    their reading (the module docstring says how)."""
    busy = trace.busy()
    main = trace.main_thread()
    starts = [s.start for s in trace.device]
    found = []
    for (_, a), (b, _) in itertools.pairwise(busy):
        if b - a < min_gap_us:
            continue
        ending = trace.device[bisect.bisect_left(starts, b)]  # the first work at the gap's end
        launch = trace.runtime.get(ending.correlation) if ending.correlation is not None else None
        thread = launch.thread if launch is not None else main
        phase = next((s.name for s in reversed(trace.stack(main, a)) if s.name.startswith(PHASE_PREFIX)), "-")
        found.append(
            Gap(
                start=a,
                end=b,
                phase=phase,
                host_bound=launch is not None and launch.start >= a,
                launched_us=None if launch is None else launch.start - a,
                dry=_innermost(trace.stack(thread, a)),
                launcher=_innermost(trace.stack(thread, launch.start)) if launch is not None else (),
                next_work=ending.name,
            )
        )
    return found


def _innermost(stack: list[Span], depth: int = 3) -> tuple[str, ...]:
    return tuple(s.name for s in stack[-depth:])


def report(trace: Trace, *, min_gap_us: float = 100.0, top: int = 12, per_phase: int = 6) -> str:
    """Markdown: the phases' wall, busy and idle time, each phase's `per_phase` longest device works,
    then the longest gaps with their reading."""
    lines = [
        "| phase | wall ms | GPU busy ms | idle ms |",
        "| --- | --- | --- | --- |",
    ]
    for p in phases(trace):
        lines.append(f"| {p.name} | {p.wall_us / 1e3:.2f} | {p.busy_us / 1e3:.2f} | {p.idle_us / 1e3:.2f} |")
    by_phase = phase_work(trace)
    if any(by_phase.values()):
        lines += ["", "| phase (launched in) | device work | calls | ms |", "| --- | --- | --- | --- |"]
        for phase, works in by_phase.items():
            for w in works[:per_phase]:
                lines.append(f"| {phase} | `{_cut(w.name)}` | {w.calls} | {w.us / 1e3:.2f} |")
    found = gaps(trace, min_gap_us)
    waited = sum(g.us for g in found if g.host_bound)
    summary = (
        f"{len(found)} device gaps of ≥ {min_gap_us:.0f} µs, {sum(g.us for g in found) / 1e3:.2f} ms in all; "
        f"{waited / 1e3:.2f} ms of them waiting for the host to launch work."
    )
    lines += ["", summary]
    if not found:
        return "\n".join(lines)
    lines += [
        "",
        "| # | ms | phase | waited for | host when the device ran dry | host launching the next work | next work |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, g in enumerate(sorted(found, key=lambda g: -g.us)[:top], 1):
        waited_for = (
            "the host" if g.host_bound else "queued work (another stream or rank)" if g.launched_us is not None else "?"
        )
        lines.append(
            f"| {i} | {g.us / 1e3:.2f} | {g.phase} | {waited_for} | {_names(g.dry)} | {_names(g.launcher)} | "
            f"`{_cut(g.next_work)}` |"
        )
    return "\n".join(lines)


def _names(names: tuple[str, ...]) -> str:
    return " › ".join(f"`{_cut(n, 40)}`" for n in names) or "–"


def _cut(name: str, chars: int = 60) -> str:
    return name if len(name) <= chars else name[: chars - 3] + "..."
