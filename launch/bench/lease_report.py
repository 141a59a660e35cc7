"""Where a device's time went, from a lease trace: `python -m launch.bench.lease_report FILE [--top N]`.

Run any Kiln command with KILN_LEASE_TRACE=FILE (protocols/lease.py): every hold of the device lease,
in every process that inherits the variable, is a line of FILE. This report reads them:

- the exclusive holds (the timed windows) by holder: their time, and the time each waited for the
  shared holders to drain after it won the turnstile (a *drain*: from then on no new shared holder is
  let in, so every other run's device work waits with it);
- the shared holds in progress during those drains, by holder: the long holds that make everyone wait;
- the shared holds by holder: count, time held, the longest, and the time spent waiting for them;
- how much of the window the device was leased at all (idle time is time no stage asked for it).

On the GPU, `KILN_LEASE_TRACE=/tmp/lease.jsonl python -m launch.bench.gpu_verifier --mix solutions`
then `python -m launch.bench.lease_report /tmp/lease.jsonl` is how session 33 found the convoy behind
the sandbox's start (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Hold:
    kind: str  # "shared" or "exclusive"
    pid: int
    holder: str  # module.function:line
    asked: float
    granted: float
    released: float
    turnstile: float | None = None  # exclusive: when it won the turnstile (then waited for the drain)

    @property
    def held_s(self) -> float:
        return self.released - self.granted

    @property
    def waited_s(self) -> float:
        return self.granted - self.asked

    @property
    def drain(self) -> tuple[float, float] | None:
        return (self.turnstile, self.granted) if self.turnstile is not None else None


def read(path: str) -> list[Hold]:
    """The holds of a trace file; a line that is not a hold (a torn last line) is skipped."""
    holds = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                d = json.loads(line)
                holds.append(
                    Hold(
                        str(d["kind"]),
                        int(d["pid"]),
                        str(d["holder"]),
                        float(d["asked"]),
                        float(d["granted"]),
                        float(d["released"]),
                        float(d["turnstile"]) if d.get("turnstile") is not None else None,
                    )
                )
            except (ValueError, KeyError, TypeError):
                continue
    return holds


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of `spans`."""
    total, end = 0.0, None
    start = None
    for a, b in sorted(spans):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    return total + (end - start if end is not None else 0.0)


@dataclass
class Report:
    window_s: float
    leased_s: float  # the device under any lease
    exclusive: dict[str, list[float]]  # holder -> [count, held s, drain s]
    in_drains: dict[str, float]  # shared holder -> seconds held during exclusive holders' drains
    shared: dict[str, list[float]]  # holder -> [count, held s, longest s, waited s]

    @property
    def exclusive_s(self) -> float:
        return sum(v[1] for v in self.exclusive.values())

    @property
    def drain_s(self) -> float:
        return sum(v[2] for v in self.exclusive.values())


def analyse(holds: list[Hold]) -> Report:
    if not holds:
        return Report(0.0, 0.0, {}, {}, {})
    window = max(h.released for h in holds) - min(h.asked for h in holds)
    exclusive: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    shared: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    in_drains: dict[str, float] = defaultdict(float)
    shared_holds = [h for h in holds if h.kind == "shared"]
    for h in holds:
        if h.kind == "exclusive":
            row = exclusive[h.holder]
            row[0] += 1
            row[1] += h.held_s
            a, b = h.drain or (h.granted, h.granted)
            row[2] += b - a
            for s in shared_holds:  # what this drain waited for
                overlap = min(b, s.released) - max(a, s.granted)
                if overlap > 0:
                    in_drains[s.holder] += overlap
        else:
            row = shared[h.holder]
            row[0] += 1
            row[1] += h.held_s
            row[2] = max(row[2], h.held_s)
            row[3] += h.waited_s
    leased = covered([(h.granted, h.released) for h in holds])
    return Report(window, leased, dict(exclusive), dict(in_drains), dict(shared))


def render(report: Report, top: int) -> str:
    head = (
        f"window {report.window_s:.1f} s; device leased {report.leased_s:.1f} s; exclusive holds "
        f"{report.exclusive_s:.1f} s, their drains {report.drain_s:.1f} s"
    )
    lines = [head, "exclusive, by holder: count, held s, drain s"]
    for name, (n, held, drain) in sorted(report.exclusive.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {name:70s} {n:6d} {held:8.2f} {drain:8.2f}")
    lines.append("shared holds during the drains, by holder: s")
    for name, s in sorted(report.in_drains.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {name:70s} {s:8.2f}")
    lines.append("shared, by holder: count, held s, longest s, waited s")
    for name, (n, held, longest, waited) in sorted(report.shared.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {name:70s} {n:6d} {held:8.2f} {longest:8.2f} {waited:8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.bench.lease_report", description=__doc__.splitlines()[0])
    p.add_argument("trace", help="the file KILN_LEASE_TRACE named")
    p.add_argument("--top", type=int, default=15, help="rows per table")
    args = p.parse_args(argv)
    try:
        holds = read(args.trace)
    except OSError as err:
        print(f"lease_report: cannot read {args.trace}: {err.strerror}", file=sys.stderr)
        return 2
    print(render(analyse(holds), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
