"""Validation metrics: the columns of the MusaCoder model card, computed from verifier verdicts.

A rollout actor samples every validation task n times (`eval.samples`, first turn only) and verifies
each sample with the same verifier as training (`RolloutActor.evaluate`); `eval_metrics` turns those
verdicts into numbers. Definitions (per task,
then averaged with equal weight over tasks):

* pass@k  — the unbiased estimator of Chen et al. (2021) from n samples of which c passed:
            1 − C(n−c, k) / C(n, k); the chance that at least one of k samples drawn without
            replacement passes. "Passed" is `VerifyResult.passed`: extracted, compiled, correct on
            every trial, legal.
* avg@k   — c / n: the mean per-sample pass rate (the expected pass@1 of one sample), using all n
            samples, which estimates the average over k samples without bias.
* fast_1 eager / compile — KernelBench's fast_p at p = 1, averaged over samples: the share of the
            task's samples that passed AND ran faster than the baseline (speedup > 1 vs eager PyTorch,
            resp. vs torch.compile). A passed sample without a measured speedup counts as not fast.
            A column is left out when no sample of the whole evaluation has that speedup measured
            (e.g. the compile baseline is off on the cpu backend).

Samples whose verdict is `infra` (the system's fault, not the policy's) are dropped before counting.
A task with fewer than k remaining samples cannot give pass@k; it is skipped and counted.
"""

from __future__ import annotations

from math import comb
from statistics import fmean

from protocols import VerifyResult


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passes (requires 0 <= c <= n and 1 <= k <= n)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def fast_p(results: list[VerifyResult], baseline: str, p: float = 1.0) -> float:
    """Share of `results` that passed with speedup over `baseline` ('eager' or 'compile') above p."""
    attr = {"eager": "speedup_eager", "compile": "speedup_compile"}[baseline]
    fast = [r.passed and getattr(r, attr) is not None and getattr(r, attr) > p for r in results]
    return sum(fast) / len(fast)


def eval_metrics(results: dict[str, list[VerifyResult]], k: int) -> dict[str, float]:
    """`eval/pass@k`, `eval/avg@k`, `eval/fast1_eager`, `eval/fast1_compile` and the counts
    `eval/tasks`, `eval/tasks_skipped`, `eval/samples`, `eval/infra` (see the module docstring)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    usable: dict[str, list[VerifyResult]] = {}
    infra = skipped = 0
    for task_id, verdicts in results.items():
        kept = [r for r in verdicts if r.error_class != "infra"]
        infra += len(verdicts) - len(kept)
        if len(kept) < k:
            skipped += 1
        else:
            usable[task_id] = kept
    out = {
        "eval/tasks": float(len(usable)),
        "eval/tasks_skipped": float(skipped),
        "eval/samples": float(sum(len(v) for v in usable.values())),
        "eval/infra": float(infra),
    }
    if not usable:
        return out
    per_task = list(usable.values())
    out[f"eval/pass@{k}"] = fmean(pass_at_k(len(v), sum(r.passed for r in v), k) for v in per_task)
    out[f"eval/avg@{k}"] = fmean(sum(r.passed for r in v) / len(v) for v in per_task)
    for baseline in ("eager", "compile"):
        attr = f"speedup_{baseline}"
        if any(getattr(r, attr) is not None for v in per_task for r in v):
            out[f"eval/fast1_{baseline}"] = fmean(fast_p(v, baseline) for v in per_task)
    return out
