"""`KernelVerifier`: the staged kernel verifier, a reward actor like any other.

    extract -> static legality scan -> compile (BuildService: jailed capture and build processes,
            symbol check of every built library, cached) -> run + correctness (a sealed, jailed
            sandbox; outputs read from its I/O arena and compared here) -> performance (paired trips
            on the verifier's clock, the baselines by the same protocol here) -> score + feedback

The trust boundary: whatever runs candidate code is untrusted, and that is every process but this
one. The verdict, the comparison, the clock that counts and the verdict cache live here. One zygote
forks every jailed process (compile and execution alike); each one that loads candidate code seals
itself first (fence.py) and stays sealed until it exits. At start-up a probe sandbox reports which
confinement layers hold on this machine, and every verdict's diagnostics repeat what is missing.

`verify()` is synchronous and thread-safe: the VerifierActor calls it from several threads at once,
so compiles of later requests proceed while earlier ones execute (the build pool and the sandbox
pool are separate, each bounded by its own setting). It never raises for a bad candidate or a
broken task; a failure of the system itself comes back as an `infra` result (score 0).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from actors.base import Slot
from actors.verifier import native, redact
from actors.verifier import reward as fb
from actors.verifier.extract import extract
from actors.verifier.interface import RewardActor
from actors.verifier.lanes import Lanes, build_lanes
from actors.verifier.legality import Violation, static_scan
from actors.verifier.outcome import RunOutcome
from actors.verifier.reference import ReferenceError
from actors.verifier.runner import CandidateRun
from actors.verifier.verdicts import VerdictCache, verdict_key
from actors.verifier.workers import compile_workers, run_workers, verifier_gpus
from actors.verifier.zygote import Zygote
from configs import VerifierConfig
from protocols import VerifyRequest, VerifyResult

log = logging.getLogger(__name__)
PCH_WARM_S = 1800.0  # the warm-up waits this long at most for the start-up precompiled headers


def resolve_cache_dir(cfg: VerifierConfig) -> Path:
    """verifier.cache_dir, else $KILN_CACHE_DIR/verifier, else ~/.cache/kiln/verifier."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    env = os.environ.get("KILN_CACHE_DIR")
    return Path(env) / "verifier" if env else Path.home() / ".cache" / "kiln" / "verifier"


class KernelVerifier(RewardActor):
    """Implements the reward-actor interface (actors/verifier/interface.py) for kind="kernel" tasks.
    `slot`: its actor's placement, whose GPUs it runs candidates on (None: every GPU this process sees)."""

    takes_slot = True

    def __init__(self, cfg: VerifierConfig, *, slot: Slot | None = None) -> None:
        self.cfg = cfg
        self.device = "cuda" if cfg.backend == "cuda" else "cpu"
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("verifier.backend=cuda but no CUDA device is visible to this process")
            torch.backends.cuda.matmul.allow_tf32 = False  # references run at full fp32 precision
            torch.backends.cudnn.allow_tf32 = False
        self.cache_dir = resolve_cache_dir(cfg)
        from actors.verifier.build import BuildService, devices  # the compile subsystem

        self.zygote = Zygote()
        self.compile_workers = compile_workers(cfg.compile_workers)  # 0 = the node's cores
        gpus = verifier_gpus(slot, torch.cuda.device_count()) if self.device == "cuda" else ()
        free = torch.cuda.mem_get_info(gpus[0].device)[0] if gpus else None
        self.run_workers = run_workers(cfg.backend, cfg.run_workers, len(gpus), device_bytes=free)  # 0 = sized
        self.builds = BuildService(
            self.cache_dir / "build",
            cfg.backend,
            self.compile_workers.count,
            cfg.compile_timeout_s,
            memory_limit_mb=cfg.memory_limit_mb,
            zygote=self.zygote,
            device=devices.describe(gpus[0].device if gpus else 0) if self.device == "cuda" else None,
        )
        self.toolchain = str(self.builds.toolchain_id)
        self.lanes = Lanes(
            build_lanes(
                cfg,
                gpus,
                self.run_workers,
                self.zygote,
                hidden=(str(self.cache_dir),),
                visible=(),  # a sandbox sees its own build's libraries only, linked for it (executor.py)
            )
        )
        self.verdicts = VerdictCache(self.cache_dir / "verdicts")
        # This verifier's own directories, named neutrally in whatever leaves it (redact.py).
        self._roots = {str(self.cache_dir.resolve()): "<cache>", str(self.cache_dir): "<cache>"}
        self.counts = {"verified": 0, "cached": 0, "broken_tasks": 0}
        self._lock = threading.Lock()
        # Set by close(): a run it cuts short (its sandbox gone with the zygote) says nothing about the
        # candidate, so it is answered infra and never cached (the cache is shared by every verifier
        # of a service: a cached -1 would be every client's answer to that candidate).
        self.closing = False
        # Requests in verification here (by request id): their run once it exists, for cancel(); and
        # those cancelled, answered as such whatever their run reports.
        self._inflight: dict[str, CandidateRun | None] = {}
        self._cancelled: set[str] = set()
        # Which confinement layers hold here, said now and in every verdict; on cuda, every lane's
        # probe also proves that its sandboxes see exactly its GPU.
        reports = [lane.pool.probe() for lane in self.lanes.all]
        self.sandbox = reports[0]
        for lane in self.lanes.all:  # a jailed reference's process must hold every layer this machine has
            lane.references.jail.machine_missing = frozenset(self.sandbox.get("missing") or {})
        native.ensure_loaded(self.zygote.native_library)  # the timing protocol's CallClock, here too
        missing = self.sandbox.get("missing") or {}
        if missing:
            log.warning(
                "verifier: sandbox layers unavailable on this machine: %s",
                "; ".join(f"{k}: {v}" for k, v in missing.items()),
            )
        else:
            log.info("verifier: sandbox layers active: %s", ", ".join(self.sandbox.get("active") or []))
        log.info(
            "verifier: %d compile workers (%s); %d sandbox workers (%s) on %s",
            self.compile_workers.count,
            self.compile_workers.why,
            self.run_workers.count,
            self.run_workers.why,
            ", ".join(f"{lane.device} ×{lane.workers}" for lane in self.lanes.all),
        )

    def warm(self) -> None:
        """Start the sandbox zygote now (it imports torch) instead of on the first request, then wait for
        the precompiled headers queued at start-up: while this runs, the actor's health says it warms
        up, and the driver's progress line says so (minutes on a cold machine, seconds after)."""
        self.zygote.start()
        self.builds.wait_pch(PCH_WARM_S)

    # ------------------------------------------------------------------------------- verify

    def verify(self, request: VerifyRequest) -> VerifyResult:
        started = time.perf_counter()
        try:
            result = self._verify(request, started)
        except Exception as err:  # a bug or a broken machine: the system's fault, never the policy's
            log.exception("verifier: request %s failed", request.request_id)
            result = self._result(
                request,
                stage="run",
                error_class="infra",
                q=0.0,
                source_hash="",
                feedback=fb.infra_feedback(f"{type(err).__name__}: {err}"),
                diagnostics={"exception": f"{type(err).__name__}: {err}"},
                timings={"total": time.perf_counter() - started},
            )
        with self._lock:
            self.counts["verified"] += 1
            self.counts["cached"] += int(result.cached)
        return result

    def _verify(self, request: VerifyRequest, started: float) -> VerifyResult:
        task = request.task
        timings: dict[str, float] = {}
        if task.kind != "kernel" or task.kernel is None:
            return self._infra(request, f"the kernel verifier cannot verify tasks of kind {task.kind!r}", timings)
        if task.kernel.backend != self.cfg.backend:
            return self._infra(
                request,
                f"task {task.task_id} is for backend {task.kernel.backend!r}, this verifier runs {self.cfg.backend!r}",
                timings,
            )
        t0 = time.perf_counter()
        ext = extract(request.candidate)
        timings["extract"] = time.perf_counter() - t0
        if not ext.ok:
            return self._result(
                request,
                stage="extract",
                error_class="extract",
                q=0.0,
                source_hash=ext.source_hash,
                feedback=fb.extract_feedback(ext.error),
                diagnostics={"error": ext.error},
                timings=timings,
            )
        key = verdict_key(ext.source_hash, task, self.toolchain, self.cfg)
        cached = self.verdicts.get(key, ext.source_hash, task.task_id)
        if cached is not None:
            cached.request_id, cached.cached = request.request_id, True
            cached.timings = {"cache": time.perf_counter() - started}
            return cached
        with self._lock:
            self._inflight[request.request_id] = None
        try:
            result = self._verify_source(request, ext.source, ext.source_hash, timings)
        finally:
            with self._lock:
                self._inflight.pop(request.request_id, None)
                cancelled = request.request_id in self._cancelled
                self._cancelled.discard(request.request_id)
        result.timings["total"] = time.perf_counter() - started
        if self.closing or cancelled:
            why = (
                "the verifier was stopped during this verification"
                if self.closing
                else "this verification was cancelled: its caller's deadline passed"
            )
            return self._infra(request, why, timings, ext.source_hash)
        self.verdicts.put(key, result)
        return result

    def cancel(self, request_id: str) -> bool:
        """End the verification of `request_id` now: nobody waits for it any more (a service's deadline
        passed). Its sandbox is killed, or none is started; the call answers infra and nothing of it is
        cached. A build under way finishes (its libraries are cached for the next request). False when
        no such request is being verified here."""
        with self._lock:
            if request_id not in self._inflight:
                return False
            self._cancelled.add(request_id)
            run = self._inflight[request_id]
        if run is not None:
            run.cancel()
        return True

    def _verify_source(self, request: VerifyRequest, source: str, digest: str, timings: dict) -> VerifyResult:
        diagnostics: dict = {
            "backend": self.cfg.backend,
            "toolchain": self.toolchain,
            "sandbox": {"missing": dict(self.sandbox.get("missing") or {})},
        }
        t0 = time.perf_counter()
        violations, vendors = static_scan(source, allow_vendor_libs=self.cfg.legality.allow_vendor_libs)
        timings["static"] = time.perf_counter() - t0
        if violations:
            return self._cheating(request, digest, violations, vendors, diagnostics, timings, stage="legality")
        t0 = time.perf_counter()
        build = self.builds.submit(source).result(timeout=self.cfg.compile_timeout_s + 120)
        timings["compile"] = time.perf_counter() - t0
        try:  # the build's libraries stay in the cache until the sandbox has its own links to them
            return self._verify_built(request, source, digest, build, diagnostics, timings, vendors)
        finally:
            pins = getattr(build, "pins", None)
            if pins is not None:
                pins.release()

    def _verify_built(
        self, request, source: str, digest: str, build, diagnostics: dict, timings: dict, vendors
    ) -> VerifyResult:
        diagnostics["build"] = {
            "seconds": build.seconds,
            "cached": bool(build.cached),
            "phases": {k: float(v) for k, v in (build.phases or {}).items()},
            "capture_exit": dict(build.capture_exit or {}),
        }
        diagnostics["sandbox"]["missing"].update((build.sandbox or {}).get("missing") or {})
        vendors = sorted(set(vendors) | set(build.vendor_libs or ()))
        diagnostics["vendor_libs"] = vendors
        found = [Violation.from_json(v) for v in build.violations or []]
        if found:  # what the built libraries import, or what module-level code did: cheating
            return self._cheating(request, digest, found, vendors, diagnostics, timings, stage="legality")
        if not build.ok:
            return self._build_failed(request, digest, build, diagnostics, timings)
        if vendors and not self.cfg.legality.allow_vendor_libs:
            found = [
                Violation(
                    "vendor_lib",
                    ", ".join(vendors),
                    "",
                    "vendor libraries are switched off (verifier.legality.allow_vendor_libs)",
                )
            ]
            return self._cheating(request, digest, found, vendors, diagnostics, timings, stage="legality")
        with self.lanes.take() as lane:  # a GPU's sandboxes, and the reference and clock on that GPU
            try:  # a client's reference runs jailed (reference.ReferenceCache); its failures are infra
                with lane.references.use(request.task) as ref:
                    run = CandidateRun(
                        self.cfg, ref, lane.pool, lane.lease, lane.baselines, lane.bandwidth, lane.memory
                    )
                    with self._lock:
                        if request.request_id in self._cancelled:
                            run.cancelled.set()
                        self._inflight[request.request_id] = run
                    outcome = run.run(source, digest, dict(build.artifacts), build.toolchain or self.toolchain)
            except ReferenceError as err:
                return self._infra(request, str(err), timings, digest)
        diagnostics["device"] = lane.device
        timings.update({k: round(v, 6) for k, v in outcome.timings.items()})
        return self._from_outcome(request, digest, outcome, vendors, diagnostics, timings)

    # ------------------------------------------------------------------------------ results

    def _from_outcome(
        self, request, digest: str, out: RunOutcome, vendors: list[str], diagnostics: dict, timings: dict
    ) -> VerifyResult:
        trials = [t.to_json() for t in out.trials]
        violations = [v.to_json() for v in out.violations]
        diagnostics.update({"trials": trials, "violations": violations, "notes": out.notes, "params": out.params})
        if out.provenance or out.precompute:
            diagnostics["provenance"] = {**out.provenance, "before_first_input": out.precompute}
        diagnostics["families"] = out.families_json()
        diagnostics["sandbox"]["missing"].update((out.sandbox or {}).get("missing") or {})
        diagnostics["sandbox"]["exit"] = dict(out.exit or {})
        diagnostics["sandbox"]["limits"] = dict(out.limits or {})
        errors = [t["max_abs_error"] for t in trials if t["max_abs_error"] is not None]
        if errors:
            diagnostics["max_abs_error"] = max(errors)
        q = out.q
        if out.error_class == "cheating":
            if out.message:
                diagnostics["error"] = out.message
            return self._cheating(request, digest, out.violations, vendors, diagnostics, timings, stage=out.stage, q=q)
        if out.error_class == "infra":
            if out.broken_task:
                diagnostics["broken_task"] = True
                with self._lock:
                    self.counts["broken_tasks"] += 1
                log.warning("verifier: %s", out.message)
            return self._infra(request, out.message, timings, digest, diagnostics)
        if out.error_class in ("runtime", "timeout"):
            text = (
                fb.runtime_feedback(out.message) if out.error_class == "runtime" else fb.timeout_feedback(out.message)
            )
            diagnostics["error"] = out.message
            return self._result(
                request,
                stage=out.stage,
                error_class=out.error_class,
                q=q,
                source_hash=digest,
                feedback=text,
                diagnostics=diagnostics,
                timings=timings,
            )
        if out.error_class == "correctness":
            return self._result(
                request,
                stage="correctness",
                error_class="correctness",
                q=q,
                source_hash=digest,
                feedback=fb.correctness_feedback(trials, q),
                diagnostics=diagnostics,
                timings=timings,
            )
        return self._passed(request, digest, out, vendors, diagnostics, timings)

    def _passed(
        self, request, digest: str, out: RunOutcome, vendors: list[str], diagnostics: dict, timings: dict
    ) -> VerifyResult:
        """A correct, legal candidate: its speedups (none beyond 1 for a time below the device's
        physical bound), the score they earn, and the feedback."""
        eager = out.eager_s / out.candidate_s if out.eager_s and out.candidate_s else None
        compiled = out.compile_s / out.candidate_s if out.compile_s and out.candidate_s else None
        diagnostics.update(
            {
                "times_s": {"candidate": out.candidate_s, "eager": out.eager_s, "compile": out.compile_s},
                "timing_runs": out.timing_runs,
                "timing": out.timing,
            }
        )
        if out.implausible:  # faster than the device can move the bytes: ν = 1, no bonus
            diagnostics["speed_clamped"] = out.implausible
            diagnostics["measured_speedups"] = {"eager": eager, "compile": compiled}
            eager = min(eager, 1.0) if eager is not None else None
            compiled = min(compiled, 1.0) if compiled is not None else None
        speedup = fb.chosen_speedup(self.cfg.reward, eager, compiled)
        review = bool(speedup is not None and speedup > self.cfg.legality.review_speedup)
        diagnostics["review"] = review
        text = fb.pass_feedback(
            out.candidate_s,
            out.eager_s,
            out.compile_s,
            speedup,
            self.cfg.reward.baseline,
            vendors,
            review,
            out.implausible,
        )
        if out.profile:
            diagnostics["profile"] = out.profile
            if out.profile.get("feedback"):
                text += " " + out.profile["feedback"]
        return self._result(
            request,
            stage="done",
            error_class=None,
            q=1.0,
            source_hash=digest,
            feedback=text,
            diagnostics=diagnostics,
            timings=timings,
            speedup_eager=eager,
            speedup_compile=compiled,
            speedup=speedup,
        )

    def _build_failed(self, request, digest: str, build, diagnostics: dict, timings: dict) -> VerifyResult:
        cls = build.error_class or "compile"
        message = str(build.error or "the build failed")
        diagnostics["error"] = message
        if cls == "infra":
            return self._infra(request, message, timings, digest, diagnostics)
        text = {"compile": fb.compile_feedback, "timeout": fb.timeout_feedback}.get(cls, fb.runtime_feedback)(message)
        return self._result(
            request,
            stage="compile",
            error_class=cls,
            q=0.0,
            source_hash=digest,
            feedback=text,
            diagnostics=diagnostics,
            timings=timings,
        )

    def _cheating(
        self,
        request,
        digest: str,
        violations: list[Violation],
        vendors: list[str],
        diagnostics: dict,
        timings: dict,
        *,
        stage: str,
        q: float = 0.0,
    ) -> VerifyResult:
        found = [v.to_json() for v in violations]
        diagnostics.update({"violations": found, "vendor_libs": vendors})
        return self._result(
            request,
            stage=stage,
            error_class="cheating",
            q=q,
            source_hash=digest,
            feedback=fb.cheating_feedback(found),
            diagnostics=diagnostics,
            timings=timings,
        )

    def _infra(self, request, message: str, timings: dict, digest: str = "", diagnostics: dict | None = None):
        diag = dict(diagnostics or {}, error=message)
        return self._result(
            request,
            stage="run",
            error_class="infra",
            q=0.0,
            source_hash=digest,
            feedback=fb.infra_feedback(message),
            diagnostics=diag,
            timings=timings,
        )

    def _result(
        self,
        request: VerifyRequest,
        *,
        stage: str,
        error_class: str | None,
        q: float,
        source_hash: str,
        feedback: str,
        diagnostics: dict,
        timings: dict,
        speedup_eager: float | None = None,
        speedup_compile: float | None = None,
        speedup: float | None = None,
    ) -> VerifyResult:
        return VerifyResult(
            request_id=request.request_id,
            task_id=request.task.task_id,
            passed=error_class is None,
            stage=stage,
            error_class=error_class,
            q=q,
            score=fb.moore_score(self.cfg.reward, error_class, q, speedup),
            speedup_eager=speedup_eager,
            speedup_compile=speedup_compile,
            feedback=redact.feedback(feedback, self._roots),
            diagnostics=redact.diagnostics(diagnostics, self._roots),
            timings={k: float(v) for k, v in timings.items()},
            source_hash=source_hash,
            cached=False,
        )

    def forget_baselines(self, new_processes: bool = False) -> None:
        """Measure every task's baselines again on its next request, in fresh baseline processes if
        `new_processes` (a benchmark that compares the baselines it measured under load with quiet
        ones, and repeats them across processes; timing_fidelity.py)."""
        for lane in self.lanes.all:
            lane.baselines.forget(new_processes)
            if new_processes:
                lane.references.renew()  # a jailed reference's baselines are timed in its own process

    def close(self) -> None:
        self.closing = True
        self.lanes.close()
        self.builds.close()
        self.zygote.close()
