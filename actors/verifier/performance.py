"""Stage 5 of a run, the timed calls: the baselines, then paired trips of K fresh calls, each call
timed in the sandbox as KernelBench times one (flush, events, forward, idle device), that figure
bounded by this process's clock around the requests (trip minus null trip over K; timing.py). After
each pair one call of the trip, chosen here after the trip, has its snapshot fetched and compared
with the reference on exactly its inputs. A time below the device's physical bound
(`timing.Bandwidth`) earns no speed bonus.

`TimedStage(run, child).measure()` fills the run's outcome (`candidate_s`, `eager_s`, `timing`, ...); the
run (runner.py) has established the primary shapes and passed their correctness trials before.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from typing import TYPE_CHECKING

from actors.verifier import timing
from actors.verifier.compare import compare_outputs
from actors.verifier.executor import ChildSession
from actors.verifier.legality import Violation
from actors.verifier.tensors import dtype_name, fingerprint, nbytes

if TYPE_CHECKING:
    from actors.verifier.runner import CandidateRun

# Fresh inputs of all timed calls together stay under this many bytes (fewer calls per trip, or fewer
# pairs, for tasks with large inputs).
TIMING_INPUT_BUDGET = 1 << 30
# A trip's inputs and outputs and their snapshots (the trip's and the null trip's) live on the device at
# once, and on cpu also the last trip's inputs and outputs (sealed.py, op_stage and op_trip): K stays
# under this many bytes.
TRIP_DEVICE_BUDGET = 2 << 30


class TimedStage:
    """The timed calls of one run, on its sandbox `child`."""

    def __init__(self, run: CandidateRun, child: ChildSession) -> None:
        self.run = run
        self.child = child

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
        self.run.out.timings["baseline"] = time.perf_counter() - t0
        note = self.run.baselines.note(self.run.ref, primary.config)
        if note:
            self.run.out.notes.append(note)
        expect = [[dtype_name(t.dtype), list(t.shape)] for t in self.run.primary_trial.expected]
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
        with self.run.lease.shared():  # the warm-up pairs' inputs: fresh, as timed calls' are
            warm = [self.run.ref.fresh_inputs(primary) for _ in range(max(1, min(4, most)))]
        if not self._stage(child, warm):
            return
        trip, replies = self._trips(child, expect)
        with self.run.lease.exclusive():
            k = timing.choose_k(trip, self.run.device_type, most, self.run.cfg.warmup)
        if not self._replies_ok(replies):
            return
        pairs = min(pairs, max(timing.MIN_RUNS, calls // k))
        times = timing.TripTimes(k, self.run.device_type)
        checked = []
        started = time.perf_counter()
        i = -1
        while timing.want_more(times, pairs, time.perf_counter() - started, budget_s):
            i += 1
            with self.run.lease.shared():
                calls = [self.run.ref.fresh_inputs(primary) for _ in range(k)]
            run_s, null_s, spans, run_first = self._pair(child, calls, expect, i)
            if run_s is None:
                return
            timing.record(times, run_s, null_s, spans, run_first)
            j = random.Random(secrets.randbits(64)).randrange(k)  # chosen after the trip
            checked.append([i, j])
            if not self._check_timed(child, i, j, calls[j]):
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

    def _stage(self, child: ChildSession, calls: list[list]) -> bool:
        """The next trip's inputs into the arena and from there onto the sandbox's device (untimed)."""
        arena = child.arena
        arena.reset()
        descs = [[arena.put(x) for x in inputs] for inputs in calls]
        with self.run.lease.shared():
            reply = self.run.budget.ask(child, "stage", {"instance": self.run.primary_index, "calls": descs})
        return self._replies_ok([reply])

    def _trips(self, child: ChildSession, expect: list):
        """(trip, replies): `trip(k, null)` runs one trip of the k staged calls in the sandbox; each
        reply is kept for `_replies_ok`."""
        flush = self.run.device_type == "cuda"
        preroll, head_start = timing.preroll_s(self.run.device_type), timing.head_start_s(self.run.device_type)
        replies: list[dict] = []

        def trip(k: int, null: bool) -> list[float]:
            body = {"null": null, "expect": expect, "flush": flush, "preroll": preroll, "head_start": head_start}
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
            if reply.get("failure"):
                self.run.out.stage, self.run.out.error_class = "performance", "runtime"
                self.run.out.message = f"a timed run failed: {str(reply['failure'])[:300]}"
                return False
        return True

    def _pair(self, child: ChildSession, calls: list[list], expect: list, index: int):
        """(trip seconds, null trip seconds, the trip's per-call figures, whether the run trip went
        first) of one pair, the first two timed here around the requests; or Nones."""
        if not self._stage(child, calls):
            return None, None, None, None
        trip, replies = self._trips(child, expect)
        with self.run.lease.exclusive(), timing.responsive_gil():
            pair = timing.time_pair(trip, len(calls), index)
        if not self._replies_ok(replies):
            return None, None, None, None
        return pair

    def _check_timed(self, child: ChildSession, pair: int, call: int, inputs: list) -> bool:
        """Compare one timed call's snapshot with the reference on exactly its inputs."""
        arena = child.arena
        arena.reset()
        with self.run.lease.shared():
            expected = self.run.ref.run(self.run.primary.model, inputs)
            out = arena.region(nbytes(expected) + 64 * len(expected))
            reply = self.run.budget.ask(child, "fetch", {"call": call, "out": out})
        if not self.run.out.absorb(reply, "fetching a timed run's outputs"):
            return False
        got, why = self.run.outputs(child, reply.get("outputs"), expected)
        check = compare_outputs(got, expected, self.run.tol_override, self.run.ref.device) if got is not None else None
        if check is not None and check.ok:
            return True
        earlier = self.run.seen_outputs.get(fingerprint(got, self.run.fingerprint_key)) if got is not None else None
        if earlier is not None:
            self.run.out.violations.append(
                Violation(
                    "replayed_output",
                    f"timed run {pair + 1} returned exactly the output of trial {earlier + 1}",
                    "",
                    "results cached across calls",
                )
            )
        else:
            message = check.message if check is not None else why
            self.run.out.violations.append(
                Violation(
                    "timed_output",
                    f"while timed (run {pair + 1}), {message}",
                    "",
                    "output differs when timed (call-count dependent?)",
                )
            )
        return False

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
