"""KernelGYM's request and response shapes (its `EvaluationRequest`/`EvaluationResponse`), so a client
written for a KernelGYM server switches to Kiln by URL alone. Kiln's own protocol decides trials and
timing: the request's trial counts, warm-up, profiling and detection switches are accepted, checked for
type, and reported back in `metadata.requested`, not obeyed. `decoy_kernel` is Kiln's `cheating`.
Runtimes are milliseconds per call, as KernelGYM reports them."""

from __future__ import annotations

from launch.serve.queue import Job, JobState
from protocols import VerifyResult

# The request fields Kiln accepts and reports (name: JSON type), beside the three it uses.
REPORTED = {
    "backend": str,
    "num_correct_trials": int,
    "num_perf_trials": int,
    "num_warmup": int,
    "timeout": (int, float),
    "entry_point": str,
    "reference_backend": (str, type(None)),
    "enable_profiling": (bool, type(None)),
    "run_triton_detection": (bool, type(None)),
    "uuid": (str, type(None)),
    "use_reference_cache": bool,
    "is_valid": bool,
    "force_refresh": bool,
    "toolkit": str,
    "backend_adapter": str,
    "priority": str,
}
MAX_BATCH = 100  # KernelGYM's own bound on /evaluate/batch
ERROR_CODES = {
    "extract": "SYNTAX_ERROR",
    "compile": "COMPILATION_ERROR",
    "runtime": "RUNTIME_ERROR",
    "timeout": "TIMEOUT_ERROR",
    "correctness": "CORRECTNESS_ERROR",
    "cheating": "RUNTIME_ERROR",
    "infra": "SYSTEM_ERROR",
}


class KernelGymError(ValueError):
    """A request KernelGYM's own server would refuse too (400, one line)."""


def parse(body: object) -> dict:
    """The fields Kiln uses (task_id, reference_code, kernel_code) and the reported ones, checked."""
    if not isinstance(body, dict):
        raise KernelGymError("an evaluation request is a JSON object")
    out = {}
    for key in ("task_id", "kernel_code", "reference_code"):
        value = body.get(key)
        if not isinstance(value, str) or not value.strip():
            raise KernelGymError(f"{key} is required, a non-empty string")
        out[key] = value
    if len(out["task_id"]) > 100:
        raise KernelGymError("task_id must be at most 100 characters")
    requested = {}
    for key, kind in REPORTED.items():
        if key in body:
            if not isinstance(body[key], kind) or isinstance(body[key], bool) and kind in (int, (int, float)):
                raise KernelGymError(f"{key} has the wrong type ({type(body[key]).__name__})")
            requested[key] = body[key]
    backend = requested.get("backend", "cuda")
    if backend == "triton":
        raise KernelGymError(
            "backend 'triton': Kiln does not judge Triton answers yet; send CUDA kernels (backend 'cuda')"
        )
    if backend != "cuda":
        raise KernelGymError(f"backend {backend!r}: KernelGYM's backends are 'cuda' and 'triton'")
    out["requested"] = requested
    return out


def response(job: Job) -> dict:
    """A job as KernelGYM's EvaluationResponse."""
    base = {
        "task_id": job.tags.get("kernelgym_task_id", job.job_id),
        "metadata": {"requested": job.tags.get("requested", {})},
    }
    if job.state is JobState.EXPIRED:
        return {**base, "status": "timeout", "error_message": job.why, "error_code": "TIMEOUT_ERROR"}
    if job.state is not JobState.DONE or job.result is None:
        return {**base, "status": "pending" if job.state is JobState.QUEUED else "processing"}
    r: VerifyResult = job.result
    times = (r.diagnostics or {}).get("times_s") or {}
    reference, kernel = times.get("eager"), times.get("candidate")
    failed_stage = None if r.passed else r.error_class
    out = {
        **base,
        "status": "completed" if r.error_class != "infra" else "failed",
        "compiled": r.stage not in ("extract", "compile"),
        "correctness": r.passed or (r.error_class == "cheating" and r.q == 1.0),  # right, by a cheat
        "decoy_kernel": r.error_class == "cheating",
        "reference_runtime": reference * 1e3 if isinstance(reference, (int, float)) else None,
        "kernel_runtime": kernel * 1e3 if isinstance(kernel, (int, float)) else None,
        "speedup": r.speedup_eager,
        "error_code": ERROR_CODES.get(failed_stage) if failed_stage else None,
        "error_message": None if r.passed else r.feedback[:2000],
        "processing_time": (job.finished or 0.0) - job.submitted,
    }
    out["metadata"].update(kiln_error_class=r.error_class, kiln_score=r.score, kiln_stage=r.stage, kiln_q=r.q)
    return out
