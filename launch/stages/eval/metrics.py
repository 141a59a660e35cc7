"""The KernelBench evaluation protocol's numbers, from verified attempts (pure functions).

Definitions (docs/eval.md states them for users):

* Pass@k (per task, then averaged over tasks) — the unbiased estimator of Chen et al. (2021): a
  task with n usable attempts of which c passed scores 1 − C(n−c, k) / C(n, k), the chance that at
  least one of k attempts drawn without replacement passes. A task with fewer than k usable attempts
  cannot give Pass@k: it is left out of that column and counted (`short_of_k`).
* Avg@n (per attempt) — passed attempts / usable attempts, pooled: the mean correctness over the n
  samples. Named after n, the samples per task (Avg@8 with the paper's n = 8).
* Faster-vs-eager, Faster-vs-compile (per attempt) — the share of usable attempts that passed AND
  whose speedup over the baseline is above the threshold (strictly: at 1.1, a 1.05x kernel is not
  faster and a 1.2x one is). A passed attempt without a measured speedup is not faster. The column
  is None when no attempt of the whole evaluation has that speedup (the baseline was not timed).

"Passed" is `EvalAttempt.passed`: extracted, compiled, correct on every trial, legal. An attempt
is usable unless its verdict is infra (the system failed, not the answer); infra attempts are
excluded from every number and counted. Each row is one level; Overall pools every usable attempt
of every level (and every task, for Pass@k).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from math import comb
from typing import Protocol

from protocols import metric_keys as mk

BASELINES = ("eager", "compile")


class Verdict(Protocol):
    """What the metrics read of an attempt (`actors.rollout.evaluation.EvalAttempt` has it)."""

    task_id: str
    level: int
    passed: bool
    error_class: str | None
    speedup_eager: float | None
    speedup_compile: float | None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from n attempts with c passes (0 <= c <= n, 1 <= k <= n)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def is_faster(passed: bool, speedup: float | None, threshold: float) -> bool:
    """Correct, legal and faster than the baseline by more than `threshold`."""
    return passed and speedup is not None and speedup > threshold


def speedup_of(attempt: Verdict, baseline: str) -> float | None:
    return attempt.speedup_eager if baseline == "eager" else attempt.speedup_compile


@dataclass(frozen=True)
class Row:
    """One row of the table: a level ("level 1") or "Overall"."""

    label: str
    tasks: int  # tasks with at least one usable attempt
    attempts: int  # usable attempts (infra excluded)
    passed: int
    infra: int  # attempts excluded because their verdict was infra
    pass_at: dict[int, float | None]  # k -> Pass@k over the tasks with >= k usable attempts
    short_of_k: dict[int, int]  # k -> tasks left out of Pass@k for having fewer than k usable attempts
    avg: float | None  # Avg@n: passed / usable attempts
    faster: dict[str, float | None]  # baseline -> share of usable attempts faster by more than the threshold
    faster_count: dict[str, int]


@dataclass(frozen=True)
class Summary:
    ks: tuple[int, ...]
    n: int  # samples per task (the largest count of attempts any task has)
    fast_threshold: float
    rows: list[Row] = field(default_factory=list)  # per level, ascending, then "Overall"

    @property
    def overall(self) -> Row:
        return self.rows[-1]

    def metrics(self, prefix: str = mk.EVAL) -> dict[str, float]:
        """Flat numbers for metrics.jsonl: Overall as `eval/pass@k`, `eval/avg@n`, `eval/faster_eager`,
        ..., each level as `eval/level1/...`; counts as `eval/attempts`, `eval/infra`, ..."""
        out: dict[str, float] = {}
        for row in self.rows:
            p = prefix if row.label == "Overall" else f"{prefix}{row.label.replace(' ', '')}/"
            for k, v in row.pass_at.items():
                if v is not None:
                    out[f"{p}pass@{k}"] = v
            if row.avg is not None:
                out[f"{p}avg@{self.n}"] = row.avg
            for b, v in row.faster.items():
                if v is not None:
                    out[f"{p}faster_{b}"] = v
        o = self.overall
        out.update(
            {f"{prefix}tasks": float(o.tasks), f"{prefix}attempts": float(o.attempts), f"{prefix}infra": float(o.infra)}
        )
        for k, short in o.short_of_k.items():
            out[f"{prefix}short_of_{k}"] = float(short)
        return out


def summarize(attempts: Iterable[Verdict], ks: Iterable[int], fast_threshold: float) -> Summary:
    """Per-level rows and the Overall row (see the module docstring)."""
    attempts = list(attempts)
    ks = tuple(sorted(set(ks)))
    if not ks or ks[0] < 1:
        raise ValueError(f"k must be >= 1, got {ks}")
    measured = {b: any(speedup_of(a, b) is not None for a in attempts) for b in BASELINES}
    by_level: dict[int, list[Verdict]] = defaultdict(list)
    for a in attempts:
        by_level[a.level].append(a)
    rows = [_row(f"level {lv}", by_level[lv], ks, fast_threshold, measured) for lv in sorted(by_level)]
    rows.append(_row("Overall", attempts, ks, fast_threshold, measured))
    per_task = defaultdict(int)
    for a in attempts:
        per_task[a.task_id] += 1
    return Summary(ks=ks, n=max(per_task.values(), default=0), fast_threshold=fast_threshold, rows=rows)


def _row(label: str, attempts: list[Verdict], ks: tuple[int, ...], threshold: float, measured: dict[str, bool]) -> Row:
    usable = [a for a in attempts if a.error_class != "infra"]
    tasks: dict[str, list[Verdict]] = defaultdict(list)
    for a in usable:
        tasks[a.task_id].append(a)
    pass_at, short = {}, {}
    for k in ks:
        scores = [pass_at_k(len(v), sum(a.passed for a in v), k) for v in tasks.values() if len(v) >= k]
        pass_at[k] = sum(scores) / len(scores) if scores else None
        short[k] = len(tasks) - len(scores)
    passed = sum(a.passed for a in usable)
    counts = {b: sum(is_faster(a.passed, speedup_of(a, b), threshold) for a in usable) for b in BASELINES}
    faster = {b: (counts[b] / len(usable) if usable and measured[b] else None) for b in BASELINES}
    return Row(
        label=label,
        tasks=len(tasks),
        attempts=len(usable),
        passed=passed,
        infra=len(attempts) - len(usable),
        pass_at=pass_at,
        short_of_k=short,
        avg=passed / len(usable) if usable else None,
        faster=faster,
        faster_count=counts,
    )
