"""Stages 3-5 for one built candidate: run, correctness trials, legality verdict, performance.

This is the trusted side of an execution. It prepares every trial (fresh seeds, reference outputs),
sends inputs to the sandbox child, compares what comes back, and decides. The child only ever sees
inputs; expected outputs never leave this process. Per shape configuration the child builds one
ModelNew and sees several fresh inputs, so a result cached across calls shows up as a mismatch, and
a result replayed from an earlier call is named as such.

Timing uses two of the primary-shape trials as input sets A and B, fed in an order the child cannot
predict through one fixed input buffer; repeats of a set get one bit flipped in one element, so no
run ever sees an input it has seen before. The first timed output of each set is compared here with
the reference; every later one is compared in the child with that first one. The sum of the child's
reported run times must fit inside the wall-clock time this process measured around the request.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field

import torch

from actors.verifier import timing
from actors.verifier.baselines import Baselines, run_order
from actors.verifier.compare import compare_outputs, tolerance_for
from actors.verifier.executor import ChildSession, SandboxCrash, SandboxFailure, SandboxForged, SandboxPool
from actors.verifier.lease import DeviceLease
from actors.verifier.legality import Violation
from actors.verifier.reference import Instance, Reference, ReferenceError, ShapeConfig, Trial
from configs import VerifierConfig


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
    params: str = ""
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

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
                 baselines: Baselines) -> None:
        self.cfg, self.ref, self.pool, self.lease, self.baselines = cfg, ref, pool, lease, baselines
        self.out = RunOutcome()
        self.budget = _Budget(cfg.run_timeout_s)
        self.tol_override = _tol_override(cfg, ref)
        self.timing_sets: list[Trial] = []
        self.primary: Instance | None = None
        self.current_op = "starting the sandbox"
        self._seen_outputs: dict[str, int] = {}

    def run(self, source: str, source_hash: str, artifacts: dict | None, toolchain: str) -> RunOutcome:
        started = time.perf_counter()
        try:
            with self.pool.session() as child:
                self.out.timings["sandbox_wait"] = child.waited_s
                self.out.timings["sandbox_start"] = time.perf_counter() - started - child.waited_s
                self._execute(child, source, source_hash, artifacts, toolchain)
        except SandboxFailure as err:
            self._sandbox_failed(err)
        except ReferenceError as err:
            self.out.stage, self.out.error_class, self.out.message = "run", "infra", str(err)
        return self.out

    # ------------------------------------------------------------------------------ the stages

    def _execute(self, child: ChildSession, source: str, source_hash: str, artifacts, toolchain: str) -> None:
        self.current_op = "importing the candidate"
        t0 = time.perf_counter()
        with self.lease.shared():
            reply = self.budget.ask(child, "prepare", {
                "source": source, "source_hash": source_hash, "artifacts": artifacts, "toolchain": toolchain,
                "reference_paths": [os.path.abspath(self.ref.source_path)] if self.ref.source_path else []})
        self.out.notes += [str(n) for n in reply.get("notes", [])][:10]
        self.out.timings["import"] = time.perf_counter() - t0
        if not self._absorb(reply, "importing the module"):
            return
        t0 = time.perf_counter()
        self.out.stage = "correctness"
        configs = self.ref.shape_configs(self.cfg.backend, self.cfg.trials)
        for config in configs[1:] + configs[:1]:  # primary last: the child's ModelNew is then the one timed
            if not self._run_config(child, config):
                break
        self.out.timings["correctness"] = time.perf_counter() - t0
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
            if config.label == "primary" and len(self.timing_sets) < 2:
                self.timing_sets.append(trial)
        return True

    def _judge_trial(self, trial: Trial, reply: dict, label: str) -> None:
        shapes = trial.config.describe()
        if reply.get("failure"):
            self.out.trials.append(TrialRecord(label, shapes, False, str(reply["failure"])[:400]))
            return
        got = _tensors(reply.get("outputs"))
        result = compare_outputs(got, trial.expected, self.tol_override)
        self.out.trials.append(TrialRecord(label, shapes, result.ok, result.message, result.max_abs_error))
        # A wrong output that is bit for bit an earlier trial's *correct* output is a replayed result
        # (a constant or garbage output that merely repeats is only wrong, not replayed).
        digest = _digest(got)
        earlier = self._seen_outputs.get(digest)
        if not result.ok and earlier is not None:
            self.out.violations.append(Violation(
                "replayed_output", f"trial {trial.index + 1} returned exactly the output of trial {earlier + 1}",
                "", "results cached across calls"))
        if result.ok:
            self._seen_outputs.setdefault(digest, trial.index)

    def _time(self, child: ChildSession) -> None:
        primary = self.primary
        with self.lease.shared():
            while len(self.timing_sets) < 2:  # one primary trial only: draw another input set
                self.timing_sets.append(self.ref.trial(primary, -1))
        sets = self.timing_sets[:2]
        t0 = time.perf_counter()
        self.out.eager_s, self.out.compile_s = self.baselines.measure(self.ref, primary.config, sets, primary.model)
        self.out.timings["baseline"] = time.perf_counter() - t0
        note = self.baselines.note(self.ref, primary.config)
        if note:
            self.out.notes.append(note)
        order = run_order(self.cfg.repeats)
        tol = list(tolerance_for(sets[0].expected[0].dtype, self.tol_override))
        self.current_op = "the timed runs"
        budget_s = min(max(self.budget.left * 0.5, 1.0), 20.0)
        with self.lease.exclusive():
            started = time.perf_counter()
            reply = self.budget.ask(child, "time", {"sets": [s.inputs for s in sets], "order": order,
                                                    "warmup": self.cfg.warmup, "repeats": self.cfg.repeats,
                                                    "budget_s": budget_s, "tol": tol})
            wall = time.perf_counter() - started
        if not self._absorb(reply, "a timed run"):
            return
        times = [float(t) for t in reply.get("times", []) if isinstance(t, (int, float))]
        if not times or any(not 0 < t < 1e4 for t in times) or sum(times) > wall * 1.05 + 0.005:
            self.out.violations.append(Violation("timer", f"reported run times {times[:3]}... do not fit the "
                                                 f"{wall:.3f} s the verifier measured", "", "forging the timer"))
            return
        for k, s in enumerate(sets):
            firsts = reply.get("first") or []
            got = _tensors(firsts[k]) if k < len(firsts) else []
            check = compare_outputs(got, s.expected, self.tol_override) if got else None
            if check is not None and not check.ok:
                self.out.violations.append(Violation("timed_output", f"while timed, {check.message}", "",
                                                     "output differs when timed (call-count dependent?)"))
        for bad in (reply.get("bad_runs") or [])[:3]:
            self.out.violations.append(Violation("timed_output", str(bad)[:300], "",
                                                 "output changes from run to run while timed"))
        self.out.candidate_s = timing.median(times)
        self.out.timing_runs = len(times)

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


def _tensors(items) -> list[torch.Tensor]:
    if not isinstance(items, (list, tuple)):
        return []
    return [t for t in items if isinstance(t, torch.Tensor)]


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _args(args: list) -> str:
    text = ", ".join(repr(a) for a in args)
    return text if len(text) < 80 else text[:77] + "..."
