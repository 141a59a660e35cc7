"""The MooreEval reward ladder and the feedback text a model reads next turn.

The ladder pays only for work the verifier verified itself: below a pass the score grows with q,
the share of the planned correctness trials whose outputs the verifier checked and found correct
(trials on inputs the candidate cannot choose; a run stopped early counts the trials it never
reached as failed, outcome.py), and above a pass with the measured speedup. Rungs, lowest first:

    s = -1                             extract failure or cheating, whatever q (FLOOR)
    s = -1                             compile/runtime/timeout/correctness failure with q = 0 (FLOOR)
    s = -0.5 + 0.5·q                   compile/runtime/timeout/correctness failure with 0 < q
                                       (PARTIAL_BASE + PARTIAL_SLOPE·q: 0 at most, for a runtime
                                       error or timeout in the timed stage after every trial passed)
    s = 1 + λ·min(max(ν-1, 0), ν_max)  a pass: q = 1 and legal; ν = speedup vs `reward.baseline` (PASS + bonus)
    s = 0                              infra: the system's fault; replay excludes these from training

So an attempt gains nothing by failing differently: a runtime error or a timeout after some trials
scores exactly as a wrong answer with the same verified share, and nothing it says about itself
(an exception, a hang, an unparseable answer) lifts it above that. The rung values are fixed, not
settings: λ and ν_max (verifier.reward) shape only the bonus above a pass.

Feedback is short and concrete: the compiler's first errors, the exception and the candidate line,
the shapes and elements that mismatched with the largest error, the forbidden op and the line that
reached it, or the measured times of the candidate and of each baseline with the speedups.
"""

from __future__ import annotations

import math

from configs.verifier import RewardConfig

FLOOR = -1.0  # nothing verified: a failure with q = 0, an unextractable answer, cheating
PARTIAL_BASE, PARTIAL_SLOPE = -0.5, 0.5  # 0 < q: -0.5 + 0.5·q, so any verified trial lifts off the floor
PASS = 1.0  # every trial verified correct and legal, before the speed bonus
INFRA = 0.0  # the system failed, not the candidate (excluded from training)

NO_CREDIT = ("extract", "cheating")  # the floor whatever q says: nothing or nothing trustworthy was run
PARTIAL_CREDIT = ("compile", "runtime", "timeout", "correctness")  # scored by the verified share q

PLUMBING_HINT = (
    "Only tensor plumbing (empty/zeros/view/reshape/permute/contiguous/copy_) may run in "
    "PyTorch inside forward; the computation itself must happen in your own kernel."
)


def moore_score(cfg: RewardConfig, error_class: str | None, q: float, speedup: float | None) -> float:
    """The ladder's score of one verdict (the module docstring states it)."""
    if error_class == "infra":
        return INFRA
    if error_class in NO_CREDIT:
        return FLOOR
    if error_class is not None and error_class not in PARTIAL_CREDIT:
        raise ValueError(f"no rung for error class {error_class!r}")
    if error_class is not None or q < 1.0:
        return verified_credit(q)
    nu = speedup if speedup is not None and not math.isnan(speedup) else 1.0
    return PASS + cfg.lam * min(max(nu - 1.0, 0.0), cfg.nu_max)


def verified_credit(q: float) -> float:
    """Below a pass: the floor when nothing was verified correct, else -0.5 + 0.5·q."""
    q = 0.0 if math.isnan(q) else min(q, 1.0)
    return FLOOR if q <= 0.0 else PARTIAL_BASE + PARTIAL_SLOPE * q


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
    """A pass: the candidate's time per call and each measured baseline's (eager PyTorch, and
    torch.compile when it was timed) with the candidate's speedup over it, so a performance turn
    reads what it has to beat."""
    text = "Correct on every trial and legal."
    if implausible:
        return text + f" The measured time is not physically plausible ({implausible}); scored as no speedup."
    if candidate_s:
        baselines = [(name, s) for name, s in (("eager PyTorch", eager_s), ("torch.compile", compile_s)) if s]
        times = [f"your kernel {_ms(candidate_s)}"] + [f"{name} {_ms(s)}" for name, s in baselines]
        text += " Time per call: " + ", ".join(times) + "."
        if baselines:
            text += " Speedup " + ", ".join(f"{s / candidate_s:.2f}x vs {name}" for name, s in baselines) + "."
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
