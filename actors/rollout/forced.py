"""Forced-response candidates (benchmarks and the CPU demo only; never a default).

With `rollout.forced_candidates` set to a solutions directory, a rollout actor does not sample its
attempts: it draws each one from a pool of candidate files for the task and has the engine score
it (`GenerateRequest.forced_response`), so the behaviour logprobs are still exact under the current
weights and the learner's step is a real policy-gradient step on them. The pool gives the verifier
a realistic mix of work when the policy is too small to write kernels:

* the shipped solution (passes, with a speedup or not);
* the same solution with one statement terminator removed from its C++ source (a compile error);
* the same solution with its kernel's first `+` turned into `-` (compiles, fails correctness);
* the reference program with `Model` renamed `ModelNew` (a PyTorch fallback: the legality gate
  scores it as cheating);
* the solution cut off half-way (nothing to extract).

The variants are mechanical and deterministic, so each distinct source compiles once per run. With
`rollout.forced_fraction` < 1 the other attempts are sampled as usual, so the engine also does real
decoding work (throughput benchmarks of a random-init policy: its samples score as extraction
failures, the forced ones give the verifier its compiles, runs and timings).

With `rollout.bench.unique_forced` (benchmarks) every drawn candidate's C++ source gets a unique
comment, so it misses the verifier's build and verdict caches and is compiled for real, as a sampled
kernel of a real policy would be; without it each distinct variant compiles once per cache.
"""

from __future__ import annotations

import random
import re
import uuid
from pathlib import Path

from protocols import Task

_CPP_BLOCK = re.compile(r'(cpp_sources|cuda_sources|source)\s*=\s*(r?""")(.*?)(""")', re.S)


def solution_file(task: Task, solutions: Path) -> Path | None:
    if task.kernel is None:
        return None
    name = Path(task.kernel.source_path or task.kernel.name).name
    name = name if name.endswith(".py") else name + ".py"
    for candidate in (solutions / f"level{task.kernel.level}" / name, solutions / name):
        if candidate.is_file():
            return candidate
    return None


def _in_kernel_code(solution: str, edit) -> str | None:
    """Apply `edit` to the first embedded C++/CUDA source string; None when there is none or no change."""
    m = _CPP_BLOCK.search(solution)
    if m is None:
        return None
    body = edit(m.group(3))
    if body is None or body == m.group(3):
        return None
    return solution[:m.start(3)] + body + solution[m.end(3):]


def _drop_terminator(code: str) -> str | None:
    i = code.find(";", code.find("{"))
    return None if i < 0 else code[:i] + code[i + 1:]


def _flip_plus(code: str) -> str | None:
    i = code.find(" + ", code.find("{"))
    return None if i < 0 else code[:i] + " - " + code[i + 3:]


def fenced(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```\n"


def candidates(task: Task, solutions: Path) -> list[str]:
    """The model-output texts of the task's pool (empty for a task without a solution file)."""
    path = solution_file(task, solutions)
    if path is None:
        return []
    solution = path.read_text(encoding="utf-8")
    pool = [fenced(solution)]
    for edit in (_drop_terminator, _flip_plus):
        varied = _in_kernel_code(solution, edit)
        if varied is not None:
            pool.append(fenced(varied))
    fallback = re.sub(r"\bclass Model\(", "class ModelNew(", task.kernel.reference, count=1)
    pool.append(fenced(fallback))
    pool.append("```python\n" + solution[: len(solution) // 2])  # cut off: no closed fence, nothing to extract
    return pool


class CandidatePool:
    """Draws forced responses for a rollout actor, seeded per actor."""

    def __init__(self, solutions: str | Path, seed: int, fraction: float = 1.0, unique: bool = False) -> None:
        self.solutions = Path(solutions)
        self.rng = random.Random(seed)
        self.fraction = fraction  # share of attempts forced; the rest are sampled by the engine
        self.unique = unique  # a unique comment in every drawn candidate's C++ source (real compiles)
        self._cache: dict[str, list[str]] = {}

    def draw(self, task: Task) -> str | None:
        """One candidate text for `task`, or None when this attempt is to be sampled (by the fraction,
        or because the task has no pool)."""
        pool = self._cache.get(task.task_id)
        if pool is None:
            pool = self._cache[task.task_id] = candidates(task, self.solutions)
        if not pool or (self.fraction < 1 and self.rng.random() >= self.fraction):
            return None
        text = self.rng.choice(pool)
        if self.unique:
            text = _in_kernel_code(text, lambda code: f"{code.rstrip()}\n// kiln bench {uuid.uuid4().hex}\n") or text
        return text
