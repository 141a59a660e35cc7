"""Stages 3-5 for one built candidate: run, correctness trials, legality verdict, performance.

This is the trusted side of an execution: the sandbox runs the candidate, this process decides.
It prepares every trial (fresh seeds, reference outputs), sends inputs to the sandbox, compares what
comes back, and keeps the clock that counts. The sandbox only ever sees inputs; expected outputs
never leave this process. Per shape configuration the sandbox builds one ModelNew and sees several
fresh inputs, so a result cached across calls shows up as a mismatch, and a result replayed from an
earlier call is named as such. After the primary trials, a canary trial (an earlier trial's inputs
with a few elements changed) catches a candidate that recognises inputs by a fingerprint.

Timing: every timed run gets a fresh draw of `get_inputs()`, never seen before, staged into the
sandbox's fixed input buffers outside the window. The sandbox reports its own time for each run,
and this process measures each run's round trip and, in between, the same request without the
forward (`timing.trusted_seconds` decides which counts). A random subset of the timed runs, which
the candidate cannot predict, has its outputs fetched and compared with the reference on exactly
those inputs. A time below the device's physical bound (`timing.Bandwidth`) earns no speed bonus.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import secrets
import time
from dataclasses import dataclass, field

import torch

from actors.verifier import timing
from actors.verifier.baselines import Baselines
from actors.verifier.compare import compare_outputs
from actors.verifier.executor import ChildSession, SandboxCrash, SandboxFailure, SandboxForged, SandboxPool
from actors.verifier.legality import Violation
from actors.verifier.reference import Instance, Reference, ReferenceError, ShapeConfig, Trial
from configs import VerifierConfig
from protocols.lease import DeviceLease

# Timed runs stop short of `repeats` when their fresh inputs would exceed this many bytes in total.
TIMING_INPUT_BUDGET = 1 << 30


@dataclass
class TrialRecord:
    label: str  # "primary#0", "alt1#0"
    shapes: str
    passed: bool
    message: str = ""
    max_abs_error: float = 0.0

    def to_json(self) -> dict:
        return {"label": self.label, "shapes": self.shapes, "passed": self.passed, "message": self.message,
                "max_abs_error": self.max_abs_error if self.max_abs_error == self.max_abs_error else None}


@dataclass
class RunOutcome:
    """What execution established; `verifier.py` turns it into a VerifyResult."""

    stage: str = "run"
    error_class: str | None = None
    message: str = ""  # runtime/timeout/infra explanation
    trials: list[TrialRecord] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    candidate_s: float | None = None
    eager_s: float | None = None
    compile_s: float | None = None
    timing_runs: int = 0
    timing: dict = field(default_factory=dict)  # both clocks, which counted, the checked runs
    implausible: str = ""  # why the measured time earns no speed bonus ("" when it does)
    params: str = ""
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    sandbox: dict = field(default_factory=dict)  # the jail report of the sandbox that ran it
    exit: dict = field(default_factory=dict)  # the sandbox's own exit status

    @property
    def q(self) -> float:
        return sum(t.passed for t in self.trials) / len(self.trials) if self.trials else 0.0


class _Budget:
    """Seconds of sandbox time left for this candidate; trusted work in between does not count."""

    def __init__(self, seconds: float) -> None:
        self.left = seconds

    def ask(self, session: ChildSession, op: str, body: dict, **kw) -> dict:
        started = time.monotonic()
        try:
            return session.request(op, body, max(self.left, 0.5), **kw)
        finally:
            self.left -= time.monotonic() - started


class CandidateRun:
    """One execution of one candidate against one reference."""

    def __init__(self, cfg: VerifierConfig, ref: Reference, pool: SandboxPool, lease: DeviceLease,
                 baselines: Baselines, bandwidth: timing.Bandwidth | None = None) -> None:
        self.cfg, self.ref, self.pool, self.lease, self.baselines = cfg, ref, pool, lease, baselines
        self.bandwidth = bandwidth
        self.out = RunOutcome()
        self.budget = _Budget(cfg.run_timeout_s)
        self.tol_override = _tol_override(cfg, ref)
        self.primary: Instance | None = None
        self.primary_trials: list[Trial] = []
        self.current_op = "starting the sandbox"
        self._seen_outputs: dict[str, int] = {}

    def run(self, source: str, source_hash: str, artifacts: dict | None, toolchain: str) -> RunOutcome:
        started = time.perf_counter()
        child = None
        try:
            with self.pool.session() as child:
                self.out.sandbox = dict(child.jail)
                self.out.timings["sandbox_wait"] = child.waited_s
                self.out.timings["sandbox_start"] = time.perf_counter() - started - child.waited_s
                self._execute(child, source, source_hash, artifacts, toolchain)
        except SandboxFailure as err:
            self._sandbox_failed(err)
        except ReferenceError as err:
            self.out.stage, self.out.error_class, self.out.message = "run", "infra", str(err)
        if child is not None:
            self.out.exit = child.exit_status()
            self._absorb_evidence(child)
        self._finish()
        return self.out

    # ------------------------------------------------------------------------------ the stages

    def _execute(self, child: ChildSession, source: str, source_hash: str, artifacts, toolchain: str) -> None:
        self.current_op = "importing the candidate"
        t0 = time.perf_counter()
        with self.lease.shared():
            reply = self.budget.ask(child, "prepare", {
                "source": source, "source_hash": source_hash, "artifacts": artifacts, "toolchain": toolchain,
                "reference_paths": [os.path.abspath(self.ref.source_path)] if self.ref.source_path else []})
        self.out.timings["import"] = time.perf_counter() - t0
        if not self._absorb(reply, "importing the module"):
            return
        t0 = time.perf_counter()
        self.out.stage = "correctness"
        configs = self.ref.shape_configs(self.cfg.backend, self.cfg.trials)
        for config in configs[1:] + configs[:1]:  # primary last: the sandbox's ModelNew is then the one timed
            if not self._run_config(child, config):
                break
        if self.out.error_class is None and not self.out.violations and self.primary_trials:
            self._canary(child)
        self.out.timings["correctness"] = time.perf_counter() - t0
        self._absorb_evidence(child)
        if self.out.violations:
            self.out.stage, self.out.error_class = "legality", "cheating"
            return
        if self.out.error_class is not None:
            return
        if self.out.q < 1.0:
            self.out.error_class = "correctness"
            return
        self.out.stage = "performance"
        t0 = time.perf_counter()
        self._time(child)
        self.out.timings["performance"] = time.perf_counter() - t0
        self._absorb_evidence(child)
        if self.out.violations:
            self.out.stage, self.out.error_class = "legality", "cheating"
        elif self.out.error_class is None:
            self.out.stage = "done"

    def _run_config(self, child: ChildSession, config: ShapeConfig) -> bool:
        """Build ModelNew for one shape config and run its trials. False stops the job."""
        self.current_op = f"building ModelNew at {config.describe()}"
        with self.lease.shared():
            try:
                inst = self.ref.instance(config)
            except Exception as err:
                if config.label != "primary":  # a derived alternative shape the reference rejects
                    self.out.notes.append(f"skipped shapes {config.describe()}: the reference fails there ({err})")
                    return True
                raise ReferenceError(f"the reference fails at its own shapes: {type(err).__name__}: {err}") from err
            reply = self.budget.ask(child, "instance", {"init_args": inst.init_args, "seed": inst.init_seed,
                                                        "state_dict": inst.state_dict})
        if not self._absorb(reply, f"constructing ModelNew({_args(inst.init_args)})"):
            return False
        self.out.params = reply.get("params", "")
        if config.label == "primary":
            self.primary = inst
        for k in range(config.trials):
            index = len(self.out.trials)
            self.current_op = f"trial {index + 1} ({config.describe()})"
            with self.lease.shared():
                trial = self.ref.trial(inst, index)
                reply = self.budget.ask(child, "call", {"inputs": trial.inputs})
            if not self._absorb(reply, f"forward on trial {index + 1} ({config.describe()})"):
                return False
            self._judge_trial(trial, reply, f"{config.label}#{k}")
            if self.out.violations:
                return False
            if config.label == "primary":
                self.primary_trials.append(trial)
        return True

    def _canary(self, child: ChildSession) -> None:
        """An earlier primary trial's inputs with a few elements changed: counted for nothing but the
        replay check (a fingerprint cache hands back the earlier output, bit for bit)."""
        self.current_op = "the canary trial"
        with self.lease.shared():
            canary = self.ref.mosaic(self.primary_trials[-1], self.primary)
            reply = self.budget.ask(child, "call", {"inputs": canary.inputs})
        if self._absorb(reply, "forward on the canary trial") and not reply.get("failure"):
            self._judge_trial(canary, reply, "canary", counts=False)

    def _judge_trial(self, trial: Trial, reply: dict, label: str, *, counts: bool = True) -> None:
        shapes = trial.config.describe()
        if reply.get("failure"):
            if counts:
                self.out.trials.append(TrialRecord(label, shapes, False, str(reply["failure"])[:400]))
            return
        got = _tensors(reply.get("outputs"))
        result = compare_outputs(got, trial.expected, self.tol_override)
        if counts:
            self.out.trials.append(TrialRecord(label, shapes, result.ok, result.message, result.max_abs_error))
        # A wrong output that is bit for bit an earlier trial's *correct* output is a replayed result
        # (a constant or garbage output that merely repeats is only wrong, not replayed).
        digest = _digest(got)
        earlier = self._seen_outputs.get(digest)
        if not result.ok and earlier is not None:
            which = "the canary trial" if not counts else f"trial {trial.index + 1}"
            self.out.violations.append(Violation(
                "replayed_output", f"{which} returned exactly the output of trial {earlier + 1}",
                "", "results cached across calls"))
        if result.ok and counts:
            self._seen_outputs.setdefault(digest, trial.index)

    # -------------------------------------------------------------------------------- timing

    def _time(self, child: ChildSession) -> None:
        primary = self.primary
        input_bytes = max(_nbytes(self.primary_trials[0].inputs), 1)
        runs = min(self.cfg.repeats, max(timing.MIN_RUNS, TIMING_INPUT_BUDGET // input_bytes))
        t0 = time.perf_counter()
        self.out.eager_s, self.out.compile_s = self.baselines.measure(self.ref, primary, runs)
        self.out.timings["baseline"] = time.perf_counter() - t0
        note = self.baselines.note(self.ref, primary.config)
        if note:
            self.out.notes.append(note)
        with self.lease.shared():
            sets = [self.ref.fresh_inputs(primary) for _ in range(runs)]
        checked = set(random.Random(secrets.randbits(64)).sample(range(runs), max(2, runs // 4)))
        self.current_op = "the timed runs"
        budget_s = min(max(self.budget.left * 0.5, 1.0), 20.0)
        reported, trips, nulls = [], [], []
        # the sandbox's own time per request, and its wall clock around the timed window
        handled: dict[str, list[float]] = {"run": [], "null": [], "run_window": [], "null_window": []}
        with self.lease.exclusive(), timing.responsive_gil():
            for w in range(self.cfg.warmup):  # untimed, on inputs the candidate has seen already
                self._one_run(child, self.primary_trials[w % len(self.primary_trials)].inputs)
            started = time.perf_counter()
            for i, inputs in enumerate(sets):
                reply, trip, null = self._one_run(child, inputs, handled)
                if reply is None:
                    return
                reported.append(_claimed_seconds(reply))
                trips.append(trip)
                nulls.append(null)
                if i in checked and not self._check_timed(child, i, inputs):
                    return
                if len(trips) >= timing.MIN_RUNS and time.perf_counter() - started > budget_s:
                    break
        seconds, clock = timing.trusted_seconds(reported, trips, nulls, self.baselines.device_type)
        self.out.candidate_s = seconds
        self.out.timing_runs = len(trips)
        self.out.timing = {"clock": clock, "sandbox_s": timing.median(reported), "round_trip_s": min(trips),
                           "null_s": min(nulls), "runs": len(trips),
                           # where a round trip goes: the sandbox's handling of each request, which it
                           # reports (untrusted, so diagnostics only, never the verdict)
                           "run_handled_s": min(handled["run"], default=None),
                           "null_handled_s": min(handled["null"], default=None),
                           "run_window_s": min(handled["run_window"], default=None),
                           "null_window_s": min(handled["null_window"], default=None),
                           "checked": sorted(i for i in checked if i < len(trips))}
        if clock == "verifier":
            self.out.notes.append("the sandbox reported less time than the verifier measured around its runs: "
                                  "the verifier's clock counts")
        self._plausibility(seconds)

    def _one_run(self, child: ChildSession, inputs: list, handled: dict[str, list[float]] | None = None):
        """Stage one run's inputs, then time it (sandbox clock and this process's round trip), then
        time the same request without the forward, then let the sandbox run its untimed post-run
        checks. (reply, round trip, null round trip) or Nones."""
        reply = self.budget.ask(child, "stage", {"inputs": inputs})
        if not self._absorb(reply, "staging a timed run"):
            return None, 0.0, 0.0
        t0 = time.perf_counter()
        reply = self.budget.ask(child, "run", {})
        trip = time.perf_counter() - t0
        if not self._absorb(reply, "a timed run"):
            return None, 0.0, 0.0
        if reply.get("failure"):
            self.out.stage, self.out.error_class = "performance", "runtime"
            self.out.message = f"a timed run failed: {str(reply['failure'])[:300]}"
            return None, 0.0, 0.0
        t0 = time.perf_counter()
        null = self.budget.ask(child, "run", {"null": True})
        null_trip = time.perf_counter() - t0
        if not self._absorb(null, "a timed run"):
            return None, 0.0, 0.0
        if not self._absorb(self.budget.ask(child, "settle", {}), "a timed run"):
            return None, 0.0, 0.0
        if handled is not None:
            for key, r in (("run", reply), ("null", null)):
                for field, suffix in (("handled_s", ""), ("window_s", "_window")):
                    if isinstance(r.get(field), (int, float)):
                        handled[key + suffix].append(float(r[field]))
        return reply, trip, null_trip

    def _check_timed(self, child: ChildSession, index: int, inputs: list) -> bool:
        """Compare one timed run's outputs with the reference on exactly its inputs."""
        reply = self.budget.ask(child, "outputs", {})
        if not self._absorb(reply, "fetching a timed run's outputs"):
            return False
        got = _tensors(reply.get("outputs"))
        expected = self.ref.run(self.primary.model, inputs)
        check = compare_outputs(got, expected, self.tol_override)
        if check.ok:
            return True
        earlier = self._seen_outputs.get(_digest(got))
        if earlier is not None:
            self.out.violations.append(Violation("replayed_output", f"timed run {index + 1} returned exactly the "
                                                 f"output of trial {earlier + 1}", "", "results cached across calls"))
        else:
            self.out.violations.append(Violation("timed_output", f"while timed (run {index + 1}), {check.message}",
                                                 "", "output differs when timed (call-count dependent?)"))
        return False

    def _plausibility(self, seconds: float) -> None:
        """No speed bonus for a time no kernel could reach: reading the inputs and writing the outputs
        once takes at least `bytes / (calibrated bandwidth x slack)`."""
        if self.bandwidth is None:
            return
        moved = _nbytes(self.primary_trials[0].inputs) + _nbytes(self.primary_trials[0].expected)
        floor = self.bandwidth.min_seconds(moved)
        self.out.timing["min_plausible_s"] = floor
        if seconds < floor:
            self.out.implausible = (f"{seconds * 1e6:.1f} us per call moves {moved} bytes faster than this device "
                                    f"can ({floor * 1e6:.1f} us at the calibrated bandwidth x{self.bandwidth.SLACK:g}): "
                                    "no speed bonus")

    # ------------------------------------------------------------------------------ replies

    def _absorb(self, reply: dict, doing: str) -> bool:
        """Record findings and errors of a reply; False when the job cannot go on."""
        self.out.violations += reply.get("findings", [])
        if reply.get("ok"):
            return True
        err = reply.get("error") if isinstance(reply.get("error"), dict) else {}
        kind, msg, where = str(err.get("type", "Error")), str(err.get("message", "")), str(err.get("where", ""))
        self.out.stage = "run"
        if reply.get("internal"):
            self.out.error_class, self.out.message = "infra", f"sandbox error while {doing}: {kind}: {msg}"
        else:
            self.out.error_class = "runtime"
            self.out.message = f"{kind} while {doing}" + (f" at {where}" if where else "") + (f": {msg}" if msg else "")
        if self.out.violations:
            self.out.stage, self.out.error_class = "legality", "cheating"
        return False

    def _absorb_evidence(self, child: ChildSession) -> None:
        """What the compute fence wrote to the evidence pipe: it holds even if the sandbox's own reply
        was tampered with afterwards."""
        child.drain_evidence()
        known = {(v.kind, v.what) for v in self.out.violations}
        for v in child.evidence:
            if (v.kind, v.what) not in known:
                self.out.violations.append(v)
                known.add((v.kind, v.what))
        child.evidence.clear()

    def _finish(self) -> None:
        """Any finding makes the verdict cheating, whatever else happened (unless the system failed)."""
        if self.out.violations and self.out.error_class != "infra":
            self.out.stage, self.out.error_class = "legality", "cheating"

    def _sandbox_failed(self, err: SandboxFailure) -> None:
        doing = self.current_op
        if isinstance(err, SandboxCrash) and err.exited_cleanly:
            self.out.violations.append(Violation("exit", "the process exited with status 0 during " + doing, "",
                                                 "os._exit / exit to fake a finished run"))
        if isinstance(err, SandboxForged):
            self.out.violations.append(Violation("forged", str(err), "", "writing to the verifier's channel"))
        if self.out.violations:
            self.out.stage, self.out.error_class = "legality", "cheating"
            self.out.message = f"{err} ({doing})"
            return
        self.out.error_class = err.error_class
        if err.error_class == "timeout":
            self.out.message = (f"execution exceeded the {self.cfg.run_timeout_s:g} s limit during {doing}: "
                                "an endless loop, a deadlock, or far too slow")
        else:
            self.out.message = f"while {doing}, {err}"
        self.out.stage = "performance" if self.out.stage == "performance" else "run"


def _tol_override(cfg: VerifierConfig, ref: Reference) -> tuple[float, float] | None:
    if cfg.atol is not None or cfg.rtol is not None:
        task = ref.tolerance() or (1e-3, 1e-3)
        return (cfg.atol if cfg.atol is not None else task[0], cfg.rtol if cfg.rtol is not None else task[1])
    return ref.tolerance()


def _claimed_seconds(reply: dict) -> float:
    """The sandbox's own time for a run (untrusted: anything but a finite positive number is 0)."""
    seconds = reply.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return 0.0
    return max(float(seconds), 0.0)


def _tensors(items) -> list[torch.Tensor]:
    if not isinstance(items, (list, tuple)):
        return []
    return [t for t in items if isinstance(t, torch.Tensor)]


def _nbytes(items) -> int:
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _args(args: list) -> str:
    text = ", ".join(repr(a) for a in args)
    return text if len(text) < 80 else text[:77] + "..."
