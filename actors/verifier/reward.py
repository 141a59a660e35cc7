"""The MooreEval reward hierarchy and the feedback text a model reads next turn.

    s = -1                            extract/compile/run failure, timeout, illegality, or q = 0
    s = -0.5 + 0.5 q                  0 < q < 1
    s = 1 + λ·min(max(ν-1, 0), ν_max) q = 1 and legal; ν = speedup vs `reward.baseline`
    s = 0                             infra: the system's fault; replay excludes these from training

Feedback is short and concrete: the compiler's first errors, the exception and the candidate line,
the shapes and elements that mismatched with the largest error, the forbidden op and the line that
reached it, or the measured speedup.
"""

from __future__ import annotations

import math

from configs.verifier import RewardConfig

FAILURE_CLASSES = ("extract", "compile", "runtime", "timeout", "cheating")

PLUMBING_HINT = (
    "Only tensor plumbing (empty/zeros/view/reshape/permute/contiguous/copy_) may run in "
    "PyTorch inside forward; the computation itself must happen in your own kernel."
)


def moore_score(cfg: RewardConfig, error_class: str | None, q: float, speedup: float | None) -> float:
    if error_class == "infra":
        return 0.0
    if error_class in FAILURE_CLASSES or q <= 0.0:
        return -1.0
    if error_class == "correctness" or q < 1.0:
        return -0.5 + 0.5 * q
    nu = speedup if speedup is not None and not math.isnan(speedup) else 1.0
    return 1.0 + cfg.lam * min(max(nu - 1.0, 0.0), cfg.nu_max)


def chosen_speedup(cfg: RewardConfig, eager: float | None, compiled: float | None) -> float | None:
    """ν against the configured baseline; eager when torch.compile could not be measured."""
    if cfg.baseline == "compile" and compiled is not None:
        return compiled
    return eager


# ----------------------------------------------------------------------------------- feedback


def _cut(text: str, limit: int = 1200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 20].rstrip() + "\n... (truncated)"


def extract_feedback(error: str) -> str:
    return _cut(
        f"Could not extract a candidate: {error}. Answer with one complete Python module in a "
        "```python block that defines class ModelNew."
    )


def compile_feedback(errors: str) -> str:
    return _cut(f"Compilation failed. First errors:\n{errors}", 2400)


def runtime_feedback(message: str) -> str:
    return _cut(f"Runtime error: {message}", 1600)


def timeout_feedback(message: str) -> str:
    return _cut(f"Timeout: {message}.")


def cheating_feedback(violations: list[dict]) -> str:
    kinds = {v.get("kind") for v in violations}
    lines = []
    for v in violations[:4]:
        text = v.get("what", "")
        if v.get("via"):
            text += f" (via {v['via']})"
        if v.get("where"):
            text += f" at {v['where']}"
        lines.append(f"- {text}")
    more = f"\n- ... and {len(violations) - 4} more" if len(violations) > 4 else ""
    hint = f"\n{PLUMBING_HINT}" if kinds & {"forbidden_op", "native_op", "custom_op"} else ""
    return _cut("Rejected by the legality check (score -1):\n" + "\n".join(lines) + more + hint, 1600)


def correctness_feedback(trials: list[dict], q: float) -> str:
    failed = [t for t in trials if not t["passed"]]
    head = f"Wrong results on {len(failed)} of {len(trials)} trials (q={q:.2f})."
    details = [f"- trial {t['label']} with {t['shapes']}: {t['message']}" for t in failed[:3]]
    return _cut(head + "\n" + "\n".join(details))


def pass_feedback(
    candidate_s: float | None,
    eager_s: float | None,
    compile_s: float | None,
    speedup: float | None,
    baseline: str,
    vendors: list[str],
    review: bool,
    implausible: str = "",
) -> str:
    text = "Correct on every trial and legal."
    if implausible:
        return text + f" The measured time is not physically plausible ({implausible}); scored as no speedup."
    if candidate_s is not None and eager_s is not None:
        text += (
            f" Speedup {eager_s / candidate_s:.2f}x vs eager PyTorch ({_ms(candidate_s)} vs {_ms(eager_s)} per call)"
        )
        if compile_s is not None:
            text += f", {compile_s / candidate_s:.2f}x vs torch.compile"
        text += "."
        if speedup is not None and speedup < 1.0:
            text += f" Slower than the {baseline} baseline: look for memory-bound inefficiencies or launch overhead."
    if vendors:
        text += f" Uses {', '.join(vendors)} (allowed; reported)."
    if review:
        text += " The speedup is unusually high and is flagged for review."
    return text


def infra_feedback(message: str) -> str:
    return _cut(f"Verifier infrastructure error (not caused by the candidate): {message}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"
