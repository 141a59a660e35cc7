"""Stage 5 of a run, the timed calls: the baselines, then paired trips of K fresh calls, each call
timed in the sandbox as KernelBench times one (flush, events, forward, idle device), that figure
bounded by this process's clock around the requests (trip minus null trip over K; timing.py). After
each hold of the device every call of its trips has its snapshot fetched and compared with the
reference on exactly its inputs, and its inputs compared bit for bit with those staged: a timed call
is held to the standard of a checked one, every one of them. A time below the device's physical
bound (`timing.Bandwidth`) earns no speed bonus.

Several pairs share one exclusive hold of the device: their calls are staged together before it and
checked together after it. Every exclusive hold first waits for the lane's shared work in progress
to end (the drain); on one H200 those waits took twice the windows' own time, one hold per pair.

`TimedStage(run, child).measure()` fills the run's outcome (`candidate_s`, `eager_s`, `timing`, ...); the
run (runner.py) has established the primary shapes and passed their correctness trials before.
"""

from __future__ import annotations

import contextlib
import math
import random
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from actors.verifier import timing
from actors.verifier.compare import compare_outputs, surely_passes
from actors.verifier.executor import ChildSession
from actors.verifier.legality import Violation
from actors.verifier.outcome import aliasing
from actors.verifier.tensors import dtype_name, fingerprint, nbytes, same_bytes

if TYPE_CHECKING:
    from actors.verifier.runner import CandidateRun

# Fresh inputs of all timed calls together stay under this many bytes (fewer calls per trip, or fewer
# pairs, for tasks with large inputs).
TIMING_INPUT_BUDGET = 1 << 30
# A stage's inputs and outputs and their snapshots (the trips' and the null trip's) live on the device
# at once, and on cpu also the last trip's inputs and outputs (sealed.py, op_stage and op_trip): the
# calls of one stage stay under this many bytes.
TRIP_DEVICE_BUDGET = 2 << 30
# The calls of the trips timed in one exclusive hold (staged together, so the arena holds them: plan.py
# sizes it): up to four trips of the most calls a trip has, and beyond one trip's calls only while
# their inputs stay under STAGE_INPUT_BUDGET. The arena is page-locked at the sandbox's start, under
# the device's shared lease, so a larger arena would cost every run's start what it saves in holds.
MAX_CALLS_PER_STAGE = 4 * timing.MAX_CALLS_PER_TRIP
STAGE_INPUT_BUDGET = 256 << 20
# cuda: audit trips (traced, untimed) among the first timed pairs, and the chance of one before each
# pair after those (audit_plan).
AUDITS = 2
AUDIT_P = 0.25


class TimedStage:
    """The timed calls of one run, on its sandbox `child`."""

    def __init__(self, run: CandidateRun, child: ChildSession) -> None:
        self.run = run
        self.child = child
        self.expect: list = []  # [dtype name, shape] of each output, as measure() finds them

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Seconds spent in one part of the stage, summed into the outcome's `timings["timed_<name>"]`
        (draw, stage, trips, check; audit trips are in all four, beside the timed ones): where a
        verification's time goes, in every verdict."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            key = f"timed_{name}"
            self.run.out.timings[key] = self.run.out.timings.get(key, 0.0) + time.perf_counter() - t0

    def measure(self) -> None:
        """Time the candidate and its baselines; the figures, or the finding that stopped them, go
        into the run's outcome."""
        child = self.child
        primary = self.run.primary
        input_bytes = max(nbytes(self.run.primary_trial.inputs), 1)
        pairs = self.run.cfg.repeats
        t0 = time.perf_counter()
        eager, compiled = self.run.baselines.measure(self.run.ref, primary, pairs)
        self.run.out.eager_s = eager.paid_s
        self.run.out.compile_s = compiled.paid_s if compiled is not None else None
        self.run.out.timings["baseline"] = self.run.out.timings.get("baseline", 0.0) + time.perf_counter() - t0
        note = self.run.baselines.note(self.run.ref, primary.config)
        if note:
            self.run.out.notes.append(note)
        expect = [[dtype_name(t.dtype), list(t.shape)] for t in self.run.primary_trial.expected]
        self.expect = expect  # the outputs' dtypes and shapes: each staged call gets snapshots of them
        output_bytes = max(nbytes(self.run.primary_trial.expected), 1)
        # Every timed call gets a fresh draw, and all of them together stay within the input budget:
        # K from the warm-up (within the device budget), then as many pairs as the budget allows.
        calls = max(timing.MIN_RUNS, TIMING_INPUT_BUDGET // input_bytes)
        most = max(
            1,
            min(
                timing.MAX_CALLS_PER_TRIP,
                TRIP_DEVICE_BUDGET // trip_bytes(self.run.device_type, input_bytes, output_bytes),
                calls // timing.MIN_RUNS,
            ),
        )
        self.run.current_op = "the timed runs"
        budget_s = min(max(self.run.budget.left * 0.5, 1.0), 20.0)
        if self._staged(child, max(1, min(4, most))) is None:  # the warm-up trips' inputs: fresh, as timed calls' are
            return
        trip, replies = self._trips(child, expect)
        with self._phase("trips"), self.run.lease.exclusive():
            k = timing.choose_k(trip, self.run.device_type, most, self.run.cfg.warmup)
        if not self._replies_ok(replies):
            return
        pairs = min(pairs, max(timing.MIN_RUNS, calls // k))
        times = timing.TripTimes(k, self.run.device_type)
        checked = []
        per_stage = stage_trips(self.run.device_type, input_bytes, output_bytes, k)
        holds = Holds(audit_plan(self.run.device_type, pairs), per_stage)
        started = time.perf_counter()
        while timing.want_more(times, pairs, time.perf_counter() - started, budget_s):
            trips = holds.next(max(1, max(pairs, timing.MIN_RUNS) - len(times.per_call)))
            staged = self._staged(child, k * len(trips))
            if staged is None:
                return
            timed = self._hold(child, k, expect, trips)
            if timed is None:
                return
            for pair, (run_s, null_s, spans, run_first) in timed:
                timing.record(times, run_s, null_s, spans, run_first)
                checked.append([pair, k])
            with self._phase("check"):
                for at, (_audit, pair) in enumerate(trips):
                    if not self._check_trip(child, pair, staged, at * k, k):
                        return
        self.run.out.candidate_s = times.paid_s
        self.run.out.timing_runs = len(times.per_call) * k
        self.run.out.timing = {
            "clock": "per-call events bounded by the verifier's clock"
            if self.run.device_type == "cuda"
            else "per-call monotonic clock bounded by the verifier's clock",
            "candidate": times.to_json(),
            "eager": eager.to_json(),
            "compile": compiled.to_json() if compiled is not None else None,
            "checked": checked,
            "median_s": {
                "candidate": times.median_s,
                "eager": eager.median_s,
                "compile": compiled.median_s if compiled else None,
            },
        }
        self._plausibility(times.paid_s)

    def _staged(self, child: ChildSession, count: int) -> list[list] | None:
        """`count` fresh draws, staged as the next trip's calls (None: the sandbox failed). Drawn and
        staged in one shared hold of the device: while an exclusive holder (a timed window) is queued,
        a run waits for it once a trip, not once for the draw and again for the staging."""
        with contextlib.ExitStack() as hold:
            with self._phase("draw"):  # the wait for the device included, as in every phase
                hold.enter_context(self.run.lease.shared())
                calls = [self.run.ref.fresh_inputs(self.run.primary) for _ in range(count)]
            return calls if self._stage(child, calls) else None

    def _stage(self, child: ChildSession, calls: list[list]) -> bool:
        """The next trip's inputs into the arena and from there onto the sandbox's device (untimed); the
        caller holds the device's shared lease."""
        arena = child.arena
        with self._phase("stage"):
            arena.reset()
            descs = [[arena.put(x) for x in inputs] for inputs in calls]
            body = {"instance": self.run.primary_index, "calls": descs, "expect": self.expect}
            reply = self.run.budget.ask(child, "stage", body)
        return self._replies_ok([reply])

    def _trips(self, child: ChildSession, expect: list, *, trace: bool = False):
        """(trip, replies): `trip(k, null, first)` runs one trip of the k staged calls from `first` on
        in the sandbox; each reply is kept for `_replies_ok`. `trace`: the device records the trip's
        kernels (an audit trip; a timed one is never traced: the trace's own cost would be in its figures)."""
        flush = self.run.device_type == "cuda"
        preroll, head_start = timing.preroll_s(self.run.device_type), timing.head_start_s(self.run.device_type)
        replies: list[dict] = []

        def trip(k: int, null: bool, first: int = 0) -> list[float]:
            body = {
                "null": null,
                "first": first,
                "count": k,
                "expect": expect,
                "flush": flush,
                "preroll": preroll,
                "head_start": head_start,
                "trace": trace,
            }
            reply = self.run.budget.ask(child, "trip", body)
            replies.append(reply)
            spans = reply.get("calls_s")
            if null or reply.get("failure") or not reply.get("ok", True):
                return []
            if not per_call_figures(spans, k):
                reply["failure"] = "the sandbox's per-call clock did not give one figure per call"
                return []
            return spans

        return trip, replies

    def _replies_ok(self, replies: list[dict]) -> bool:
        for reply in replies:
            if not self.run.out.absorb(reply, "a timed run"):
                return False
            aliased = reply.get("aliased")
            if type(aliased) is int and aliased >= 0:
                self.run.out.violations.append(aliasing(aliased))
                return False
            if reply.get("failure"):
                self.run.out.stage, self.run.out.error_class = "performance", "runtime"
                self.run.out.message = f"a timed run failed: {str(reply['failure'])[:300]}"
                return False
        return True

    def _hold(self, child: ChildSession, k: int, expect: list, trips: list[tuple[bool, int]]):
        """The staged trips of k calls each, in order, in one exclusive hold of the device: a timed
        pair, or an audit trip (run as a timed trip is, but traced: whose kernels ran, provenance.py;
        timed by nobody). The sandbox cannot tell the two apart: it sees the same requests, in an
        order it cannot predict (`audit_plan`). [(pair index, (trip seconds, null trip seconds, the
        trip's per-call figures, whether the run trip went first))] of the timed pairs; None when a
        trip failed (the run's outcome says how), the hold ending there."""
        trip, replies = self._trips(child, expect)
        traced, traced_replies = self._trips(child, expect, trace=True)
        timed = []
        with self._phase("trips"), self.run.lease.exclusive(), timing.responsive_gil():
            for at, (audit, pair) in enumerate(trips):
                first = at * k
                if audit:
                    traced(k, False, first)
                else:
                    figures = timing.time_pair(lambda n, null, first=first: trip(n, null, first), k, pair)
                    timed.append((pair, figures))
                if any(r.get("failure") or not r.get("ok", True) for r in (*replies, *traced_replies)):
                    break
        if not self._replies_ok(traced_replies) or not self._replies_ok(replies):
            return None
        return timed

    def _check_trip(self, child: ChildSession, pair: int, calls: list[list], first: int, count: int) -> bool:
        """Every call of a trip (the `count` staged `calls` from `first` on) against the reference on
        exactly its inputs, and its inputs as the trip left them against those staged; fetched as many
        calls a request as the arena holds. The reference runs and the fast comparisons of a batch
        queue on the device and are read once (compare.surely_passes); a call they do not clear is
        judged by compare_outputs, one by one."""
        arena = child.arena
        k, end = first, first + count
        while k < end:
            arena.reset()
            batch, expected = [], []
            with self.run.lease.shared():
                while k < end:
                    want = self.run.ref.run(self.run.primary.model, calls[k], wait=False)
                    tensors = [x for x in calls[k] if isinstance(x, torch.Tensor)]
                    need = nbytes(want) + 64 * len(want) + nbytes(tensors) + 64 * len(tensors) + arena.ALIGN * 2
                    if batch and arena.used + need > arena.size:
                        break
                    batch.append(
                        [
                            k,
                            arena.region(nbytes(want) + 64 * len(want)),
                            arena.region(nbytes(tensors) + 64 * len(tensors)),
                        ]
                    )
                    expected.append((want, tensors))
                    k += 1
                reply = self.run.budget.ask(child, "fetch", {"calls": batch})
            if not self.run.out.absorb(reply, "fetching a timed run's outputs"):
                return False
            found = reply.get("calls")
            if type(found) is not list or len(found) != len(batch):
                self.run.out.violations.append(
                    Violation("timed_output", "the sandbox did not return the timed calls' outputs", "", "forged reply")
                )
                return False
            entries = [(entry + [None, None])[:2] if type(entry) is list else (None, None) for entry in found]
            cleared = self._cleared(child, entries, expected)
            for (call, _out, _kept), (want, tensors), (outputs, inputs), fast in zip(
                batch, expected, entries, cleared, strict=True
            ):
                if not fast and not self._check_call(child, pair, call - first, outputs, want):
                    return False
                if not self._inputs_kept(child, inputs, tensors, pair):
                    return False
        return True

    def _cleared(self, child: ChildSession, entries: list, expected: list) -> list[bool]:
        """Per call of a batch, whether compare.surely_passes clears its outputs: every flag queued on
        the device, then read in one wait."""
        flags = []
        for (outputs, _inputs), (want, _tensors) in zip(entries, expected, strict=True):
            got, _ = self.run.judge.outputs(child, outputs, want)
            flag = surely_passes(got, want, self.run.tol_override, self.run.ref.device) if got is not None else None
            flags.append(flag)
        queued = [f for f in flags if f is not None]
        read = iter(torch.stack([f.to(queued[0].device) for f in queued]).tolist() if queued else [])
        return [bool(next(read)) if f is not None else False for f in flags]

    def _check_call(self, child: ChildSession, pair: int, call: int, entries, expected: list) -> bool:
        """One timed call's snapshot against the reference's outputs on its inputs."""
        got, why = self.run.judge.outputs(child, entries, expected)
        check = compare_outputs(got, expected, self.run.tol_override, self.run.ref.device) if got is not None else None
        if check is not None and check.ok:
            return True
        earlier = (
            self.run.judge.seen_outputs.get(fingerprint(got, self.run.judge.fingerprint_key))
            if got is not None
            else None
        )
        if earlier is not None:
            self.run.out.violations.append(
                Violation(
                    "replayed_output",
                    f"timed run {pair + 1} (call {call + 1}) returned exactly the output of trial {earlier + 1}",
                    "",
                    "results cached across calls",
                )
            )
        else:
            message = check.message if check is not None else why
            self.run.out.violations.append(
                Violation(
                    "timed_output",
                    f"while timed (run {pair + 1}, call {call + 1}), {message}",
                    "",
                    "output differs when timed (call-count dependent?)",
                )
            )
        return False

    def _inputs_kept(self, child: ChildSession, entries, staged: list, pair: int) -> bool:
        """A timed call's inputs, as the trip left them, bit for bit against those staged."""
        kept, _ = self.run.judge.outputs(child, entries, staged, snapshot=False)
        if kept is None:
            return True  # nothing placed to compare (no tensor inputs)
        for i, (before, after) in enumerate(zip(staged, kept, strict=True)):
            if not same_bytes(before, after):
                self.run.out.violations.append(
                    Violation(
                        "input_mutated",
                        f"input {i} was modified in place while timed (run {pair + 1})",
                        "",
                        "forward must not write to its inputs",
                    )
                )
                return False
        return True

    def _plausibility(self, seconds: float) -> None:
        """No speed bonus for a time no kernel could reach: reading the inputs and writing the outputs
        once takes at least `bytes / (calibrated bandwidth x slack)`."""
        if self.run.bandwidth is None:
            return
        moved = nbytes(self.run.primary_trial.inputs) + nbytes(self.run.primary_trial.expected)
        floor = self.run.bandwidth.min_seconds(moved)
        self.run.out.timing["min_plausible_s"] = floor
        if seconds < floor:
            self.run.out.implausible = (
                f"{seconds * 1e6:.1f} us per call moves {moved} bytes faster than this device "
                f"can ({floor * 1e6:.1f} us at the calibrated bandwidth x{self.run.bandwidth.SLACK:g}): "
                "no speed bonus"
            )


def audit_plan(device_type: str, pairs: int):
    """`audits(i)`: whether an audit trip (`TimedStage._hold`) goes before timed pair i. On cuda, at
    AUDITS of the first `pairs` pairs, chosen at random here, and after those (while the trusted
    figure wants more pairs) with probability AUDIT_P; on cpu never (the samples cover every timed
    call: provenance.py). A candidate that changes what runs in a share f of its trips is seen with
    probability 1 - (1 - f)^audits."""
    if device_type != "cuda":
        return lambda i: False
    rng = random.Random(secrets.randbits(64))
    chosen = set(rng.sample(range(pairs), min(AUDITS, pairs)))
    return lambda i: i in chosen if i < pairs else rng.random() < AUDIT_P


class Holds:
    """The trips of each exclusive hold, in order: (audit, pair index) for each, a pair's audit trip
    (if `audits` wants one) right before it, at most `per_stage` trips a hold. A pair and its audit
    stay in one hold; a pair that would not fit waits, its audit decided, for the next."""

    def __init__(self, audits, per_stage: int) -> None:
        self.audits = audits
        self.per_stage = max(1, per_stage)
        self.placed = -1  # the last pair given out
        self._decided: dict[int, bool] = {}

    def _audit(self, pair: int) -> bool:
        if pair not in self._decided:
            self._decided[pair] = bool(self.audits(pair))
        return self._decided[pair]

    def next(self, wanted: int) -> list[tuple[bool, int]]:
        """The next hold's trips: up to `wanted` pairs (at least one) and their audits."""
        trips: list[tuple[bool, int]] = []
        pairs = 0
        while pairs < max(1, wanted):
            pair = self.placed + 1
            audit = self._audit(pair)
            if trips and len(trips) + 1 + audit > self.per_stage:
                break
            if 1 + audit > self.per_stage:  # a stage holds one trip: the audit now, alone; its pair next
                self._decided[pair] = False
                return [(True, pair)]
            if audit:
                trips.append((True, pair))
            trips.append((False, pair))
            self.placed, pairs = pair, pairs + 1
        return trips


def stage_calls(input_bytes: int) -> int:
    """The most calls one stage may hold, by their inputs (the arena's part for the timed calls)."""
    inputs = max(input_bytes, 1)
    wanted = min(MAX_CALLS_PER_STAGE, max(timing.MAX_CALLS_PER_TRIP, STAGE_INPUT_BUDGET // inputs))
    return max(1, min(wanted, TIMING_INPUT_BUDGET // inputs))


def stage_trips(device_type: str, input_bytes: int, output_bytes: int, k: int) -> int:
    """How many trips of k calls one stage holds: within `stage_calls` (the arena holds that many:
    plan.py) and the device budget of a stage."""
    calls = min(stage_calls(input_bytes), TRIP_DEVICE_BUDGET // trip_bytes(device_type, input_bytes, output_bytes))
    return max(1, calls // max(k, 1))


def trip_bytes(device_type: str, input_bytes: int, output_bytes: int) -> int:
    """What one call of a trip keeps on the device: its inputs, its outputs and two snapshots; on cpu
    also the last trip's inputs and outputs, held until replaced."""
    held = input_bytes + output_bytes if device_type == "cpu" else 0
    return input_bytes + 2 * output_bytes + held


def per_call_figures(spans, k: int) -> bool:
    """Exactly k finite, non-negative seconds (the sandbox's reply is read as data)."""
    return (
        type(spans) is list
        and len(spans) == k
        and all(type(x) in (float, int) and math.isfinite(x) and x >= 0 for x in spans)
    )
