"""Forced-response candidates (benchmarks and the CPU demo only; never a default).

With `rollout.forced_candidates` set to a solutions directory, a rollout actor does not sample its
attempts: it draws each one from a pool of candidate files for the task and has the engine score
it (`GenerateRequest.forced_response`), so the behaviour logprobs are still exact under the current
weights and the learner's step is a real policy-gradient step on them. The pool gives the verifier
a realistic mix of work when the policy is too small to write kernels. Its variants, by name:

* `solution`: the shipped solution (passes, with a speedup or not);
* `compile_error`: one statement terminator removed from its C++ source (a compile error);
* `wrong_result`: its kernel's first ` + ` turned into ` - ` (compiles, fails correctness; only
  for solutions whose kernel code has one);
* `fallback`: the reference program with `Model` renamed `ModelNew` (a PyTorch fallback: the
  legality gate scores it as cheating);
* `cut_off`: the solution cut off half-way (an unclosed fence: nothing to extract);
* `hang`: an endless loop (on a `volatile` flag, so no compiler may drop it) as the first statement
  of the kernel source's first function body: it compiles and runs until `verifier.run_timeout_s`
  ends it (a timeout verdict; timeouts are never cached, so each costs the whole limit);
* `crash`: a write through a null pointer as that same first statement: it compiles and faults when it
  runs (a segfault on the host, an illegal address on the device: a runtime verdict).

`rollout.forced_mix` weighs the variants: each draw picks a variant with probability proportional
to its weight among the variants the task has, then that variant's text. Every variant is
mechanical and deterministic, so each distinct source compiles once per run; every turn draws
afresh, so a failed first turn's repair turn may draw a passing candidate. With
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
from collections.abc import Mapping
from pathlib import Path

from configs import ConfigError
from configs.rollout import FORCED_MIX
from configs.rollout import FORCED_VARIANTS as VARIANTS
from protocols import Task

_CPP_BLOCK = re.compile(r'(cpp_sources|cuda_sources|source)\s*=\s*(r?""")(.*?)(""")', re.DOTALL)
_FUNCTION_BODY = re.compile(r"\)\s*(?:const\s*)?\{")  # the `{` that opens a function's body

# The endless loop of the `hang` variant: a volatile flag makes every test a side effect, so the
# loop is well defined and stays in the program at any optimisation level.
SPIN = "for (volatile int kiln_spin = 1; kiln_spin;) {}"
# The fault of the `crash` variant: through a volatile pointer, so the write is never optimised away.
CRASH = "*(volatile int *)0 = 1;"


def solution_file(task: Task, solutions: Path) -> Path | None:
    if task.kernel is None:
        return None
    name = Path(task.kernel.source_path or task.kernel.name).name
    name = name if name.endswith(".py") else name + ".py"
    for candidate in (solutions / f"level{task.kernel.level}" / name, solutions / name):
        if candidate.is_file():
            return candidate
    return None


def in_kernel_code(solution: str, edit) -> str | None:
    """Apply `edit` to the first embedded C++/CUDA source string; None when there is none or no change."""
    m = _CPP_BLOCK.search(solution)
    if m is None:
        return None
    body = edit(m.group(3))
    if body is None or body == m.group(3):
        return None
    return solution[: m.start(3)] + body + solution[m.end(3) :]


def _drop_terminator(code: str) -> str | None:
    i = code.find(";", code.find("{"))
    return None if i < 0 else code[:i] + code[i + 1 :]


def _flip_plus(code: str) -> str | None:
    i = code.find(" + ", code.find("{"))
    return None if i < 0 else code[:i] + " - " + code[i + 3 :]


def _spin_first(code: str) -> str | None:
    return _first_statement(code, SPIN)


def _crash_first(code: str) -> str | None:
    return _first_statement(code, CRASH)


def _first_statement(code: str, statement: str) -> str | None:
    m = _FUNCTION_BODY.search(code)
    return None if m is None else code[: m.end()] + "\n    " + statement + code[m.end() :]


def fenced(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```\n"


def variants(task: Task, solutions: Path) -> dict[str, str]:
    """The model-output text of each variant the task has, by name (empty for a task without a
    solution file)."""
    path = solution_file(task, solutions)
    if path is None:
        return {}
    solution = path.read_text(encoding="utf-8")
    out = {"solution": fenced(solution)}
    edits = (
        ("compile_error", _drop_terminator),
        ("wrong_result", _flip_plus),
        ("hang", _spin_first),
        ("crash", _crash_first),
    )
    for name, edit in edits:
        varied = in_kernel_code(solution, edit)
        if varied is not None:
            out[name] = fenced(varied)
    out["fallback"] = fenced(re.sub(r"\bclass Model\(", "class ModelNew(", task.kernel.reference, count=1))
    out["cut_off"] = "```python\n" + solution[: len(solution) // 2]  # no closed fence, nothing to extract
    return out


def candidates(task: Task, solutions: Path) -> list[str]:
    """The model-output texts of the task's pool, every variant once."""
    return list(variants(task, solutions).values())


def check_mix(mix: Mapping[str, float]) -> dict[str, float]:
    """`rollout.forced_mix` with every variant named (those left out weigh 0); ConfigError naming the
    problem for an unknown variant, a negative weight or nothing to draw."""
    unknown = sorted(set(mix) - set(VARIANTS))
    if unknown:
        raise ConfigError(
            f"rollout.forced_mix: unknown variant(s) {', '.join(unknown)}; the variants are {', '.join(VARIANTS)}"
        )
    weights = {name: float(mix.get(name, 0.0)) for name in VARIANTS}
    negative = [name for name, w in weights.items() if w < 0]
    if negative:
        raise ConfigError(
            f"rollout.forced_mix: weights must be >= 0, got {', '.join(f'{n}={weights[n]:g}' for n in negative)}"
        )
    if not any(weights.values()):
        raise ConfigError("rollout.forced_mix: every weight is 0, so there is nothing to draw")
    return weights


class CandidatePool:
    """Draws forced responses for a rollout actor, seeded per actor."""

    def __init__(
        self,
        solutions: str | Path,
        seed: int,
        fraction: float = 1.0,
        mix: Mapping[str, float] | None = None,
        unique: bool = False,
    ) -> None:
        self.solutions = Path(solutions)
        self.rng = random.Random(seed)
        self.fraction = fraction  # share of attempts forced; the rest are sampled by the engine
        self.mix = check_mix(FORCED_MIX if mix is None else mix)
        self.unique = unique  # a unique comment in every drawn candidate's C++ source (real compiles)
        self._cache: dict[str, tuple[list[str], list[float]]] = {}

    def draw(self, task: Task) -> str | None:
        """One candidate text for `task`, or None when this attempt is to be sampled (by the fraction,
        or because the task has no variant of positive weight)."""
        pool = self._cache.get(task.task_id)
        if pool is None:
            texts = variants(task, self.solutions)
            names = [n for n in VARIANTS if n in texts and self.mix[n] > 0]
            pool = self._cache[task.task_id] = ([texts[n] for n in names], [self.mix[n] for n in names])
        texts, weights = pool
        if not texts or (self.fraction < 1 and self.rng.random() >= self.fraction):
            return None
        text = self.rng.choices(texts, weights)[0]
        if self.unique:
            text = in_kernel_code(text, lambda code: f"{code.rstrip()}\n// kiln bench {uuid.uuid4().hex}\n") or text
        return text
