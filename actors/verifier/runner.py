"""Stages 3-5 for one built candidate: run, correctness trials, legality verdict, performance.

This is the trusted side of an execution: the sandbox runs the candidate, this process decides. A
run reserves its device memory, plans its trials (plan.py: every shape's reference instance and first
trial, the later trials' families), starts its sandbox, then poses the trials one by one (each later
one drawn just before its use: fresh seeds, reference outputs; on the primary shape, one trial of each
input family and a sensitivity trial: families.py), writes inputs into the session's I/O arena and
has each reply judged (judging.py: outputs read back as the bytes of the dtype and shape expected,
nothing else, and compared with the family's tolerance allowance). It keeps the clock that counts.
Expected outputs never leave this process. Per shape configuration the sandbox builds one ModelNew
and sees several fresh inputs, so a result cached across calls shows up as a mismatch, and one
replayed from an earlier call is named as such. After the primary trials, a canary trial (an earlier
trial's inputs with a few elements changed) catches a candidate that recognises inputs by a fingerprint.

The timed calls (stage 5) are performance.py's `TimedStage`, which this run hands its sandbox once
the primary shapes' trials have passed; the byte-level facts both use are tensors.py's.
"""

from __future__ import annotations

import threading
import time

import torch

from actors.verifier import gpumem, limits, profile, timing
from actors.verifier.arena import Arena
from actors.verifier.baselines import Baselines
from actors.verifier.cubins import device_code
from actors.verifier.device_verdicts import DeviceVerdicts
from actors.verifier.devmem import DeviceMemory, GaveUp
from actors.verifier.executor import ChildSession, SandboxFailure, SandboxPool
from actors.verifier.families import NORMAL, SENSITIVITY
from actors.verifier.judging import TrialJudge
from actors.verifier.outcome import RunOutcome, precompute_finding
from actors.verifier.performance import TimedStage
from actors.verifier.plan import Plan, ShapeTrials, arena_bytes, draw_plan
from actors.verifier.reference import (
    BrokenTask,
    DeviceFull,
    Instance,
    Reference,
    ReferenceError,
    Skipped,
    Trial,
)
from actors.verifier.tensors import nbytes
from configs import VerifierConfig
from protocols.lease import DeviceLease

# ATen compute before the first input (the candidate's import and __init__, its load hooks) is bounded:
# at most this many elements per element of the task's parameters and buffers (the reference's state
# dict, every shape's), plus PRECOMPUTE_FLOOR. Precomputation from the parameters (a transposed weight,
# the sigmoid of a weight, a few steps of an initialiser) fits; a table of the op's answers over an
# input dtype's values (65,536 for 16-bit types) does not, where the task's state is smaller. The
# candidate's own kernels may precompute anything: that is its work.
PRECOMPUTE_PER_PARAMETER = 16
PRECOMPUTE_FLOOR = 8192
# Device memory a run reserves, in trials' bytes (inputs + reference outputs; devmem.py), held from
# its first draw to its verdict: a draw on the trusted side (a trial and its forward's temporaries),
# the sandbox's trial and the candidate's own workspace, and the baseline process's inputs.
RUN_COPIES = 4


class Cancelled(Exception):
    """The run was cancelled before its sandbox started (CandidateRun.cancel)."""


class _Budget:
    """Seconds of sandbox time left for this candidate; trusted work in between does not count."""

    def __init__(self, seconds: float) -> None:
        self.left = seconds

    def ask(self, session: ChildSession, op: str, body: dict) -> dict:
        started = time.monotonic()
        try:
            return session.request(op, body, max(self.left, 0.5))
        finally:
            self.left -= time.monotonic() - started


class CandidateRun:
    """One execution of one candidate against one reference."""

    def __init__(
        self,
        cfg: VerifierConfig,
        ref: Reference,
        pool: SandboxPool,
        lease: DeviceLease,
        baselines: Baselines,
        bandwidth: timing.Bandwidth | None = None,
        memory: DeviceMemory | None = None,
    ) -> None:
        self.cfg, self.ref, self.pool, self.lease, self.baselines = cfg, ref, pool, lease, baselines
        self.bandwidth = bandwidth
        self.memory = memory or DeviceMemory(1 << 62)  # none given: uncounted (unit tests of one run)
        self.device_type = baselines.device_type
        self.out = RunOutcome()
        self.budget = _Budget(cfg.run_timeout_s)  # until the plan says the task's size (_limits)
        self.limits: limits.SandboxLimits | None = None
        self.tol_override = _tol_override(cfg, ref)
        self.primary: Instance | None = None
        self.primary_index = 0  # the sandbox's ModelNew of the primary shapes
        # The last plain primary trial (the canary is built on it; then only its sizes are kept, which
        # the timed stage reads). No other trial outlives its judging: at KernelBench's sizes each is
        # up to 16 GB, of device memory when it was drawn just before its use.
        self.primary_trial: Trial | None = None
        self.current_op = "starting the sandbox"
        self.judge = TrialJudge(self.out, ref, self.device_type, self.tol_override)  # judging.py
        self.device_reserved = 0  # the device memory this run reserved (devmem.py): its sandbox's share
        self.watched: gpumem.Watched | None = None  # its sandbox under the GPU's device watch (cuda)
        self.device: DeviceVerdicts | None = None  # where device memory decides the verdict (device_verdicts.py)
        self.cancelled = threading.Event()  # cancel(): nobody waits for this verdict any more
        self.child: ChildSession | None = None  # its sandbox, while it has one (cancel kills it)

    def cancel(self) -> None:
        """End this run now, its verdict no longer wanted (a service's deadline passed): its sandbox
        is killed, or, if it has none yet, none is started. What the run then reports says nothing of
        the candidate; the verifier answers it as cancelled and keeps nothing of it."""
        self.cancelled.set()
        self.memory.wake()  # a run still waiting for device memory stops waiting
        child = self.child
        if child is not None:
            child.kill()

    def run(self, source: str, source_hash: str, artifacts: dict | None, toolchain: str) -> RunOutcome:
        started = time.perf_counter()
        self.artifacts = artifacts
        child = None
        try:
            # A task whose size is known before drawing (meta tensors, or an earlier draw) reserves
            # its device memory once, for the run's whole life: a run waiting for memory then holds
            # nothing (no trial parked on the host, no arena written) while a large one runs. One of
            # unknown size draws alone first (_plan) and reserves when its size is known.
            known = self._known_footprint()
            waited = time.perf_counter()
            with self.memory.reserve(RUN_COPIES * known if known is not None else 0, self.cancelled) as held:
                self.out.timings["memory_wait"] = time.perf_counter() - waited
                plan = draw_plan(
                    self.cfg,
                    self.ref,
                    self.memory,
                    self.lease,
                    self.tol_override,
                    self.cancelled,
                    drawn_alone=known is None,
                )
                self.out.notes += plan.notes
                self.out.timings["reference"] = time.perf_counter() - started - self.out.timings["memory_wait"]
                # One of unknown size reserves here, before its sandbox: a run never waits for memory
                # while it holds one of the lane's sandbox slots, because the runs holding memory may
                # be waiting for a slot (devmem.py: memory first, then the sandbox, on every path).
                waited = time.perf_counter()
                with self.memory.reserve(RUN_COPIES * plan.footprint if known is None else 0, self.cancelled) as late:
                    self.out.timings["memory_wait"] += time.perf_counter() - waited
                    self.device_reserved = held or late
                    task_limits = self._limits(plan)
                    self.out.limits["device_reserved_mb"] = self.device_reserved >> 20
                    self._baselines_first(plan)
                    if self.cancelled.is_set():
                        raise Cancelled
                    with self.pool.session(plan.arena_bytes, task_limits.private_bytes, task_limits.starved) as child:
                        self.child = child
                        if self.cancelled.is_set():  # cancel() came before the sandbox was known to it
                            child.kill()
                        self._run_in(child, plan, source, source_hash, artifacts, toolchain)
        except SandboxFailure as err:
            limit_s = self.limits.run_timeout_s if self.limits else self.cfg.run_timeout_s
            self.out.sandbox_failed(err, self.current_op, limit_s)
        except BrokenTask as err:
            self.out.stage, self.out.error_class, self.out.message, self.out.broken_task = (
                "run",
                "infra",
                str(err),
                True,
            )
        except ReferenceError as err:
            self.out.stage, self.out.error_class, self.out.message = "run", "infra", str(err)
        except (Cancelled, GaveUp):
            pass  # the verifier answers a cancelled run itself (KernelVerifier.cancel)
        self.child = None
        if self.device is not None:  # the device's word on memory, over whatever else the run ended with
            self.device.watch_word(self.out, self.watched)
        if child is not None:
            self.out.exit = child.exit_status()
            self.out.absorb_evidence(child)
        self._give_back_device_memory()
        self.out.finish()
        self.out.timings["execution"] = time.perf_counter() - started
        return self.out

    def _run_in(self, child: ChildSession, plan: Plan, source: str, source_hash: str, artifacts, toolchain) -> None:
        self.out.sandbox = dict(child.jail)
        self.out.timings["sandbox_wait"] = child.waited_s
        params = sum(nbytes(list(s.inst.state_dict.values())) for s in plan.configs)
        self.device = DeviceVerdicts(self.ref.device, self.pool.gpu_uuid, gpumem.share(self.device_reserved, params))
        watch = gpumem.device_watch(self.pool.gpu_uuid) if self.device_type == "cuda" else None
        self.watched = watch.watch(child, self.device.share) if watch is not None else None
        try:
            self._execute(child, plan, source, source_hash, artifacts, toolchain)
            self.out.timings["arena_pin"] = child.arena.pin_s  # the verifier's side, beside the sandbox's start
        except (DeviceFull, torch.OutOfMemoryError) as err:  # the verifier's own work, the sandbox alive
            if self.device_type != "cuda":
                raise ReferenceError(str(err)) from None
            self.device.verifier_oom(self.out, child, err, self.current_op)
        else:
            if self.device_type == "cuda":
                self.device.candidate_oom(self.out, child)
        finally:
            if watch is not None:
                watch.unwatch(self.watched)
        self.out.inspect(child)
        self._judge_provenance(child)

    def _baselines_first(self, plan: Plan) -> None:
        """The task's baselines, measured (once per task and shapes) before this run's sandbox exists:
        nothing this candidate starts (a thread left running, a process, work on the device) can run
        beside them. The timed stage reads them from the cache. A task whose reference fails here is
        the run's broken task, as before. (Other runs' sandboxes of the lane may exist: with one
        sandbox a lane, the default on cpu and per GPU, none does; docs/verifier.md says what remains.)"""
        primary = plan.configs[-1].inst if plan.configs else None
        if primary is None or self.baselines.measured(self.ref, primary.config):
            return
        started = time.perf_counter()
        try:
            self.baselines.measure(self.ref, primary, self.cfg.repeats)
        except Exception:  # noqa: BLE001 - the reference fails at timing: the trials judge the task first
            return  # (a broken task is found there; the timed stage measures, and reports, as before)
        finally:
            self.out.timings["baseline"] = time.perf_counter() - started

    def _judge_provenance(self, child: ChildSession) -> None:
        """Whose code did the work (provenance.py): the sandbox's samples over the windows of its
        requests, judged once the run's last judged request is answered."""
        allow = self.cfg.legality.allow_vendor_libs
        if self.device_type == "cuda":
            code = device_code(list((self.artifacts or {}).values()))
            record = child.cuda_provenance(frozenset(code.names), code.unreadable, allow)
            self.out.notes += code.notes
            self.out.provenance["cuda"] = record.to_json()
        else:
            record = child.provenance(allow)
            self.out.provenance["cpu"] = record.to_json()
        known = {(v.kind, v.what) for v in self.out.violations}
        # Plumbing alone is a finding only for outputs that were right: a wrong one is judged wrong.
        judged = [v for v in record.findings if v.kind != "plumbing_only" or (self.out.q == 1.0 and self.out.trials)]
        self.out.violations += [v for v in judged if (v.kind, v.what) not in known]

    # ------------------------------------------------------------------------- trusted work

    def _give_back_device_memory(self) -> None:
        """Trials drawn on the device and dropped leave their blocks in this process's caching
        allocator, where another process (the baseline process, a sandbox, another run's) cannot have
        them: at KernelBench's sizes, tens of GB. Handed back to the device before the timed stage
        and at the run's end."""
        if self.device_type == "cuda":
            torch.cuda.empty_cache()

    def _limits(self, plan: Plan) -> limits.SandboxLimits:
        """The sandbox's memory and time limits for this task (limits.py), recorded for the verdict;
        the time budget starts from them."""
        task_limits = limits.derive(
            self.device_type,
            self.cfg.memory_limit_mb,
            self.cfg.run_timeout_s,
            limits.trial_bytes([shape.first for shape in plan.configs]),
            sum(shape.count for shape in plan.configs) + 1,  # the canary
            Arena.size_for(plan.arena_bytes),
            param_bytes=sum(nbytes(list(s.inst.state_dict.values())) for s in plan.configs),
        )
        self.limits, self.budget = task_limits, _Budget(task_limits.run_timeout_s)
        self.out.limits = task_limits.to_json()
        if task_limits.private_bytes > task_limits.floor_bytes or task_limits.capped:
            self.out.notes.append(f"sandbox limits for this task's size: {task_limits.describe()}")
        return task_limits

    def _known_footprint(self) -> int | None:
        """Bytes of the largest trial's inputs and outputs over the task's shape configs, known before
        drawing; None when one of them cannot be known until drawn."""
        sizes = [self.ref.footprint(c) for c in self.ref.shape_configs(self.cfg.backend, self.cfg.trials)]
        return None if any(s is None for s in sizes) else max(sizes, default=0)

    def _trials(self, plan: Plan, shape: ShapeTrials):
        """The shape's trials in order, as (label, trial), each later one drawn (trusted work, outside
        the sandbox's time budget) when the one before it has been judged. A family trial the
        reference cannot take is skipped and reported (diagnostics.families), never planned; a draw
        larger than the plan is a broken task (its sizes change)."""
        self._drew(shape.label, shape.first)
        yield shape.label, shape.first
        for planned in shape.later:
            started = time.perf_counter()
            with self.lease.shared():  # used at once: never parked
                if planned.family == SENSITIVITY:
                    trial = self.ref.sensitivity_trial(
                        shape.inst, shape.first, planned.index, self.tol_override, infinite_ok=shape.infinite_ok
                    )
                else:
                    trial = self.ref.trial(
                        shape.inst,
                        planned.index,
                        planned.family,
                        waits=False,
                        infinite_ok=shape.infinite_ok,
                        tolerance=self.tol_override,
                    )
            self.out.timings["reference"] = self.out.timings.get("reference", 0.0) + time.perf_counter() - started
            if isinstance(trial, Skipped):
                self.out.planned -= 1  # never posed: neither passed nor failed
                self.out.family_skipped(trial.drawn.family, trial.drawn.params, trial.why, list(trial.notes))
                continue
            self._drew(planned.label, trial)
            if arena_bytes(trial) > plan.largest_trial:
                raise ReferenceError(
                    f"the reference's get_inputs() drew larger inputs or outputs at {shape.config.describe()} "
                    f"than its first draw ({arena_bytes(trial)} > {plan.largest_trial} bytes of arena): "
                    "a task's sizes must not change between draws"
                )
            yield planned.label, trial
            trial = None  # not held while the next one is drawn

    def _drew(self, label: str, trial: Trial) -> None:
        """A trial is posed: its family, parameters and whether its reference output is degenerate go
        to the verdict's diagnostics."""
        self.judge.labels[trial.index] = label
        self.out.family_trial(
            trial.drawn.family, label, trial.drawn.params, trial.notes, trial.degenerate, trial.allowance
        )

    # ------------------------------------------------------------------------------ the stages

    def _execute(
        self, child: ChildSession, plan: Plan, source: str, source_hash: str, artifacts, toolchain: str
    ) -> None:
        self.out.planned = sum(shape.count for shape in plan.configs)  # q's denominator, however far it gets
        self.current_op = "importing the candidate"
        t0 = time.perf_counter()
        with self.lease.shared():
            reply = child.prepare(
                source, source_hash, artifacts, toolchain, timing.CPU_TIMING_THREADS, max(self.budget.left, 0.5)
            )
            if reply.get("internal") or not reply.get("ok"):
                raise SandboxFailure(f"the sandbox could not seal itself: {reply.get('error')}")
            if isinstance(reply.get("pin_s"), float):  # its side of the arena page-locked (before any candidate code)
                self.out.timings["sandbox_pin"] = reply["pin_s"]
            reply = self.budget.ask(child, "load", {})
        self.out.timings["import"] = time.perf_counter() - t0
        if not self.out.absorb(reply, "importing the module"):
            return
        self.current_op = "building ModelNew"
        arena = child.arena
        arena.reset()
        instances = [
            {
                "init": _wire_values(shape.inst.init_args),
                "seed": shape.inst.init_seed,
                "params": [[name, arena.put(t)] for name, t in shape.inst.state_dict.items()],
            }
            for shape in plan.configs
        ]
        with self.lease.shared():
            reply = self.budget.ask(child, "build", {"instances": instances})
        described = "; ".join(f"ModelNew({_args(shape.inst.init_args)})" for shape in plan.configs)
        if not self.out.absorb(reply, f"constructing {described}"):
            return
        self.out.params = ",".join(str(p)[:10] for p in (reply.get("params") or []))[:60]
        self._judge_precompute(plan, reply.get("precomputed"))
        t0 = time.perf_counter()
        self.out.stage = "correctness"
        for index, shape in enumerate(plan.configs):
            if not self._run_config(child, index, shape, self._trials(plan, shape)):
                break
        if self.out.error_class is None and not self.out.violations and self.primary_trial is not None:
            self._canary(child)
        self.out.timings["correctness"] = time.perf_counter() - t0
        self.out.inspect(child)
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
        self._give_back_device_memory()  # the baseline process and the sandbox's timed inputs need it
        TimedStage(self, child).measure()
        self.out.timings["performance"] = time.perf_counter() - t0
        self.out.inspect(child)
        if self.out.violations:
            self.out.stage, self.out.error_class = "legality", "cheating"
        elif self.out.error_class is None:
            self.out.stage = "done"
        if profile.wanted(self):  # feedback for a performance turn, after every figure and check
            profile.take(self, child)

    def _judge_precompute(self, plan: Plan, elements) -> None:
        """ATen's compute before the first input, as the fence counted it, against the task's budget."""
        if type(elements) is not int:
            return
        state = sum(t.numel() for shape in plan.configs for t in shape.inst.state_dict.values())
        budget = PRECOMPUTE_PER_PARAMETER * state + PRECOMPUTE_FLOOR
        self.out.precompute = {"elements": elements, "budget": budget}
        if elements > budget:
            self.out.violations.append(precompute_finding(elements, budget, PRECOMPUTE_PER_PARAMETER, PRECOMPUTE_FLOOR))

    def _run_config(self, child: ChildSession, index: int, shape: ShapeTrials, trials) -> bool:
        """The trials of one shape config on the sandbox's ModelNew `index`. False stops the job."""
        config = shape.config
        if config.label == "primary":
            self.primary, self.primary_index = shape.inst, index
        last_plain = ([shape.first.index] + [p.index for p in shape.later if p.family == NORMAL])[-1]
        # No enumerate: its reused result tuple would hold the last trial while the next is drawn.
        for label, trial in trials:
            self.current_op = f"trial {label} ({config.describe()})"
            with self.lease.shared():
                reply = self._call(child, index, trial)
            if not self.out.absorb(reply, f"forward on trial {label} ({config.describe()})"):
                return False
            self.judge.judge(child, trial, reply, label)
            if self.out.violations:
                return False
            if config.label == "primary" and trial.index == last_plain:
                self.primary_trial = trial
            trial = None  # not held while the next one is drawn
        return True

    def _call(self, child: ChildSession, instance: int, trial: Trial) -> dict:
        arena = child.arena
        arena.reset()
        inputs = [arena.put(x) for x in trial.inputs]
        out = arena.region(nbytes(trial.expected) + 64 * len(trial.expected))
        after = arena.region(nbytes(trial.expected) + 64 * len(trial.expected))
        kept = arena.region(nbytes(trial.inputs) + 64 * len(trial.inputs))
        return self.budget.ask(
            child, "call", {"instance": instance, "inputs": inputs, "out": out, "after": after, "kept": kept}
        )

    def _canary(self, child: ChildSession) -> None:
        """An earlier primary trial's inputs with a few elements changed: counted for nothing but the
        replay check (a fingerprint cache hands back the earlier output, bit for bit)."""
        self.current_op = "the canary trial"
        with self.lease.shared():
            canary = self.ref.mosaic(self.primary_trial, self.primary)
            self.primary_trial = self.primary_trial.shapes_only()
            reply = self._call(child, self.primary_index, canary)
        if self.out.absorb(reply, "forward on the canary trial") and not reply.get("failure"):
            self.judge.judge(child, canary, reply, "canary", counts=False)


def _tol_override(cfg: VerifierConfig, ref: Reference) -> tuple[float, float] | None:
    if cfg.atol is not None or cfg.rtol is not None:
        task = ref.tolerance() or (1e-3, 1e-3)
        return (cfg.atol if cfg.atol is not None else task[0], cfg.rtol if cfg.rtol is not None else task[1])
    return ref.tolerance()


def _wire_values(values: list) -> list:
    """Init arguments as msgpack values (tuples become lists; anything else must already be plain)."""
    return [list(v) if isinstance(v, tuple) else v for v in values]


def _args(args: list) -> str:
    text = ", ".join(repr(a) for a in args)
    return text if len(text) < 80 else text[:77] + "..."
