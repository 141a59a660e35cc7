"""Stages 3-5 for one built candidate: run, correctness trials, legality verdict, performance.

This is the trusted side of an execution: the sandbox runs the candidate, this process decides. It
prepares every trial (fresh seeds, reference outputs; on the primary shape, one trial of each input
family and a sensitivity trial: families.py), writes inputs into the session's I/O arena, reads
outputs back as bytes of the dtype and shape it expects (nothing else is ever read), compares them
(with the family's tolerance allowance), and keeps the clock that counts. Expected outputs never leave
this process. Per shape configuration the sandbox builds one ModelNew and sees several fresh
inputs, so a result cached across calls shows up as a mismatch, and one replayed from an earlier
call is named as such. After the primary trials, a canary trial (an earlier trial's inputs with a
few elements changed) catches a candidate that recognises inputs by a fingerprint.

Each trial is looked at three times: the outputs as they were when forward returned (and, on cuda,
the caller's stream was synchronised), the outputs again once the device is idle (on cpu, after a
pause), and the inputs after the call. The first must match the reference; a difference between
the first two is work that outlived forward; inputs that changed were written to.

The timed calls (stage 5) are performance.py's `TimedStage`, which this run hands its sandbox once
the primary shapes' trials have passed; the byte-level facts both use are tensors.py's.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

import torch

from actors.verifier import families, gpumem, limits, profile, timing
from actors.verifier.arena import Arena
from actors.verifier.baselines import Baselines
from actors.verifier.compare import CHUNK, compare_outputs
from actors.verifier.cubins import device_code
from actors.verifier.device_verdicts import DeviceVerdicts
from actors.verifier.devmem import DeviceMemory, GaveUp
from actors.verifier.executor import ChildSession, SandboxFailure, SandboxPool
from actors.verifier.families import NORMAL, SENSITIVITY
from actors.verifier.jailed_reference import ReferenceRaised
from actors.verifier.legality import Violation
from actors.verifier.outcome import RunOutcome, TrialRecord, aliasing, precompute_finding
from actors.verifier.performance import MAX_CALLS_PER_STAGE, TIMING_INPUT_BUDGET, TimedStage
from actors.verifier.reference import (
    BrokenTask,
    DeviceFull,
    Instance,
    Reference,
    ReferenceError,
    ShapeConfig,
    Skipped,
    Trial,
    all_finite,
)
from actors.verifier.tensors import dtype_name, fingerprint, nbytes, same_bytes
from configs import VerifierConfig
from protocols.lease import DeviceLease

# Orders each run's primary trials (families.schedule): from the operating system's randomness, so a
# candidate cannot tell a family by the position of its call.
_SCHEDULE_RNG = secrets.SystemRandom()
# cuda: a device-wide synchronize right after the caller's stream was synchronised that takes longer
# than this found work still running: work of the candidate's that outlived forward.
PENDING_S = 0.5e-3
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


@dataclass(frozen=True)
class Planned:
    """One trial of the plan, before it is drawn."""

    index: int  # across all trials of the job
    family: str  # families.NORMAL, a family of families.ALL, or families.SENSITIVITY
    label: str  # as feedback names it ("primary#1", "offset#0")


@dataclass
class ShapeTrials:
    """One shape config's reference instance and its trials. The first (a plain draw) is drawn while
    planning (its size sizes the sandbox); the rest when the sandbox is ready for them, so a candidate
    stopped on its first trial costs the trusted side one draw per shape rather than every trial's."""

    config: ShapeConfig
    inst: Instance
    first: Trial
    later: list[Planned]  # the trials after the first, in order
    label: str  # the first trial's
    infinite_ok: bool = False  # the task's own draw gives infinite outputs: a family's may too

    @property
    def count(self) -> int:
        return 1 + len(self.later)


@dataclass
class Plan:
    """The trusted work done before the sandbox starts: every instance, each shape's first trial,
    and the arena size (which every later trial of the shape must fit: the same shapes)."""

    configs: list[ShapeTrials]
    arena_bytes: int
    largest_trial: int  # bytes of arena one trial takes (inputs and outputs twice each)
    footprint: int  # bytes of the largest trial's inputs and outputs (what device memory is counted in)
    notes: list[str]


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
        # Correct outputs' fingerprints (tensors.py; sampled at places secret to this run) -> trial.
        self.seen_outputs: dict[str, int] = {}
        self.output_prints: dict[int, str] = {}  # trial index -> the fingerprint of the candidate's output
        self.labels: dict[int, str] = {}  # trial index -> its label
        self.fingerprint_key = secrets.randbits(62)
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
                plan = self._plan(drawn_alone=known is None)
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

    def _plan(self, *, drawn_alone: bool) -> Plan:
        """Every shape config's reference instance and first trial (alternative shapes first, the
        primary last, so the sandbox's last ModelNew is the one timed), the order of the later trials
        (the primary's: its plain trials, one per input family and the sensitivity trial, shuffled,
        then its last plain one, on which the canary is built; families.schedule), and an arena that
        holds the largest trial's inputs, its outputs twice and its inputs again, or the timed calls.
        `drawn_alone`: the task's size is unknown (no reservation is held), so each first draw
        reserves the lane's whole budget."""
        configs, notes = [], []
        largest_trial, largest_inputs = 0, 1
        shape_configs = self.ref.shape_configs(self.cfg.backend, self.cfg.trials)
        for config in shape_configs[1:] + shape_configs[:1]:
            with self.memory.reserve(self.memory.budget if drawn_alone else 0, self.cancelled), self.lease.shared():
                try:
                    inst = self.ref.instance(config)
                except ReferenceError:  # a jailed reference's process that failed: no other shape would do
                    raise
                except Exception as err:
                    if config.label != "primary":  # a derived alternative shape the reference rejects
                        notes.append(f"skipped shapes {config.describe()}: the reference fails there ({err})")
                        continue
                    raise _fails_at_own_shapes(err) from err
                base = len(configs) * 100
                try:
                    first = self.ref.trial(inst, base, tolerance=self.tol_override)
                except ReferenceError:
                    raise
                except Exception as err:
                    if config.label != "primary":  # a derived alternative its forward rejects (broadcasts)
                        notes.append(f"skipped shapes {config.describe()}: the reference fails there ({err})")
                        continue
                    raise _fails_at_own_shapes(err) from err
            if config.label == "primary":
                kinds = families.schedule(config.trials, _SCHEDULE_RNG)
            else:
                kinds = [NORMAL] * (config.trials - 1)
            names = families.labels(config.label, [NORMAL, *kinds])
            later = [Planned(base + k, kind, names[k]) for k, kind in enumerate(kinds, start=1)]
            _carried(first)
            configs.append(ShapeTrials(config, inst, first, later, names[0], not all_finite(first.expected)))
            largest_trial = max(largest_trial, _arena_bytes(first))
            largest_inputs = max(largest_inputs, nbytes(first.inputs))
        params = sum(nbytes(list(s.inst.state_dict.values())) + 64 * len(s.inst.state_dict) for s in configs)
        # the timed calls of one stage (performance.py), each with room for its tensors' alignment
        timed = min(MAX_CALLS_PER_STAGE, max(1, TIMING_INPUT_BUDGET // largest_inputs)) * (largest_inputs + 1024)
        primary_out = nbytes(configs[-1].first.expected) if configs else 0
        arena = max(largest_trial, params, timed + primary_out) + 64 * 1024
        footprint = max((nbytes(s.first.inputs) + nbytes(s.first.expected) for s in configs), default=0)
        return Plan(configs, arena, largest_trial, footprint, notes)

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
            if _arena_bytes(trial) > plan.largest_trial:
                raise ReferenceError(
                    f"the reference's get_inputs() drew larger inputs or outputs at {shape.config.describe()} "
                    f"than its first draw ({_arena_bytes(trial)} > {plan.largest_trial} bytes of arena): "
                    "a task's sizes must not change between draws"
                )
            yield planned.label, trial
            trial = None  # not held while the next one is drawn

    def _drew(self, label: str, trial: Trial) -> None:
        """A trial is posed: its family, parameters and whether its reference output is degenerate go
        to the verdict's diagnostics."""
        self.labels[trial.index] = label
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
            self._judge_trial(child, trial, reply, label)
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
            self._judge_trial(child, canary, reply, "canary", counts=False)

    def _judge_trial(self, child: ChildSession, trial: Trial, reply: dict, label: str, *, counts: bool = True) -> None:
        shapes = trial.config.describe()
        if reply.get("failure"):
            if reply.get("subclass"):
                self.out.violations.append(
                    Violation(
                        "output_type",
                        f"an output that poses as one: {str(reply['failure'])[:200]}",
                        "",
                        "outputs must be plain torch.Tensor objects in a plain tuple or list, not subclasses",
                    )
                )
            if counts:
                where = f" at {reply['where']}" if reply.get("where") else ""
                self.out.trials.append(TrialRecord(label, shapes, False, f"{str(reply['failure'])[:400]}{where}"))
            return
        aliased = reply.get("aliased")
        if type(aliased) is int and aliased >= 0:
            self.out.violations.append(aliasing(aliased))
        got, why = self.outputs(child, reply.get("outputs"), trial.expected)
        result = None
        if got is not None:
            result = compare_outputs(got, trial.expected, self.tol_override, self.ref.device, trial.allowance)
        seen = fingerprint(got, self.fingerprint_key) if got is not None else None
        # The sensitivity check: base's inputs perturbed until the reference's output moved MOVE
        # tolerance bounds, and the candidate's output is bit for bit what it was on base.
        unmoved = trial.base is not None and seen is not None and self.output_prints.get(trial.base) == seen
        if counts:
            if result is None:
                self.out.trials.append(TrialRecord(label, shapes, False, _on(trial, why)))
            else:
                message = result.message
                if unmoved and not result.ok:
                    message = (
                        f"the output did not change from trial {self.labels.get(trial.base, '?')}'s, whose inputs "
                        f"these perturb, while the reference's moved {trial.drawn.params.get('moved')} tolerance "
                        f"bounds: the output must follow the inputs ({message})"
                    )
                self.out.trials.append(TrialRecord(label, shapes, result.ok, _on(trial, message), result.max_abs_error))
            if seen is not None:
                self.output_prints[trial.index] = seen
        if got is None:
            return
        later, _ = self.outputs(child, reply.get("after"), trial.expected, snapshot=False)
        pending = reply.get("pending_s")
        still_running = self.device_type == "cuda" and isinstance(pending, (int, float)) and pending > PENDING_S
        if later is None or still_running or any(not same_bytes(a, b) for a, b in zip(got, later, strict=True)):
            kind = "stream_escape" if self.device_type == "cuda" else "thread_escape"
            self.out.violations.append(
                Violation(
                    kind,
                    "the outputs were still being written after forward returned",
                    "",
                    "work left running after the call escapes the output check",
                )
            )
        tensors = [x for x in trial.inputs if isinstance(x, torch.Tensor)]
        kept, _ = self.outputs(child, reply.get("inputs_after"), tensors, snapshot=False)
        # Not strict: kept is None when the child's inputs could not be read back; nothing to compare then.
        for i, (before, after) in enumerate(zip(tensors, kept or [], strict=False)):
            if not same_bytes(before, after):
                self.out.violations.append(
                    Violation(
                        "input_mutated", f"input {i} was modified in place", "", "forward must not write to its inputs"
                    )
                )
        # A wrong output that is bit for bit an earlier trial's *correct* output is a replayed result
        # (a constant or garbage output that merely repeats is only wrong, not replayed): an output
        # that ignores its inputs, right on one trial, is one on the sensitivity trial.
        earlier = self.seen_outputs.get(seen)
        if result is not None and not result.ok and earlier is not None:
            which = "the canary trial" if not counts else f"trial {label}"
            self.out.violations.append(
                Violation(
                    "replayed_output",
                    f"{which} returned exactly the output of trial {self.labels.get(earlier, earlier + 1)}",
                    "",
                    "results cached across calls",
                )
            )
        if result is not None and result.ok and counts:
            self.seen_outputs.setdefault(seen, trial.index)

    def outputs(self, child: ChildSession, entries, expected: list[torch.Tensor], *, snapshot: bool = True):
        """The outputs the sandbox placed, read as the expected dtypes and shapes (nothing else is
        read), or (None, why they cannot be). `snapshot`: copies, for outputs that are judged (the
        sandbox could rewrite the arena meanwhile); else views of the arena, for a bit-for-bit look
        at what is there now (a rewrite then shows as the difference it is). On cuda a snapshot of up
        to one comparison slice is copied straight onto the reference's device, where it is compared."""
        if not isinstance(entries, list):
            return None, "no outputs were placed"
        if len(entries) != len(expected):
            return None, f"returned {len(entries)} output(s), the reference returns {len(expected)}"
        got = []
        for i, (entry, exp) in enumerate(zip(entries, expected, strict=True)):
            name = "the output" if len(expected) == 1 else f"output {i}"
            onto = self.ref.device if snapshot and self.device_type == "cuda" and exp.numel() <= CHUNK["cuda"] else None
            t = child.arena.take(entry, exp, copy=snapshot, device=onto)
            if t is None:
                return None, _describe_mismatch(name, entry, exp, self.device_type)
            got.append(t)
        return got, ""


def _fails_at_own_shapes(err: Exception) -> ReferenceError:
    """A reference that fails at its primary shapes: a broken task (infra), in one line. A jailed
    reference's own exception already names its type (ReferenceRaised)."""
    why = str(err) if isinstance(err, ReferenceRaised) else f"{type(err).__name__}: {err}"
    return ReferenceError(f"the reference fails at its own shapes: {why}")


def _carried(trial: Trial) -> None:
    """A task whose inputs or outputs have a dtype the sandbox's channel cannot carry is the verifier's
    limit, not the candidate's failure: infra (a ReferenceError), never its -1."""
    from actors.verifier.sandbox import DTYPE_NAMES

    for t in [x for x in trial.inputs if isinstance(x, torch.Tensor)] + list(trial.expected):
        if t.dtype not in DTYPE_NAMES:
            raise ReferenceError(
                f"the verifier cannot carry tensors of dtype {dtype_name(t.dtype)}: this task is unsupported"
            )


def _arena_bytes(trial: Trial) -> int:
    """Arena one trial takes: its inputs and its outputs twice each (written, then read back)."""
    return 2 * nbytes(trial.inputs) + 2 * nbytes(trial.expected)


def _on(trial: Trial, message: str) -> str:
    """A trial's message, prefixed with what its inputs were where they were not a plain draw."""
    return message if trial.drawn.family == NORMAL or not message else f"on {trial.drawn.describe()}: {message}"


def _tol_override(cfg: VerifierConfig, ref: Reference) -> tuple[float, float] | None:
    if cfg.atol is not None or cfg.rtol is not None:
        task = ref.tolerance() or (1e-3, 1e-3)
        return (cfg.atol if cfg.atol is not None else task[0], cfg.rtol if cfg.rtol is not None else task[1])
    return ref.tolerance()


def _describe_mismatch(name: str, entry, exp: torch.Tensor, device_type: str) -> str:
    if not isinstance(entry, list) or len(entry) < 6:
        return f"{name} could not be read"
    _, nbytes, dtype, shape, _, where = entry[:6]
    if where != device_type:
        return f"{name} is on {where}, expected {device_type}"
    if dtype != dtype_name(exp.dtype):
        return f"{name} has dtype {dtype}, expected {dtype_name(exp.dtype)}"
    if shape != list(exp.shape):
        return f"{name} has shape {tuple(shape) if isinstance(shape, list) else shape}, expected {tuple(exp.shape)}"
    return f"{name} ({nbytes} bytes) does not fit where the reference's output does"


def _wire_values(values: list) -> list:
    """Init arguments as msgpack values (tuples become lists; anything else must already be plain)."""
    return [list(v) if isinstance(v, tuple) else v for v in values]


def _args(args: list) -> str:
    text = ", ".join(repr(a) for a in args)
    return text if len(text) < 80 else text[:77] + "..."
