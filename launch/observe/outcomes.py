"""Verifier outcomes as the live view and the report show them: one name and one colour each, the
same in every panel and every run.

An attempt's outcome is `passed`, or the error class of its failure (protocols.ERROR_CLASSES), in
the verifier's pipeline order. The metrics rows count them per step as `verifier/done` (passed:
the attempt went through every stage) and `verifier/error/<class>`; progress rows as
`progress/verdict/<outcome>`.
"""

from __future__ import annotations

from protocols import ERROR_CLASSES
from protocols import metric_keys as mk

# Pipeline order: how far an attempt got before it failed, then the system's own failures.
OUTCOMES = ("passed", "extract", "compile", "runtime", "timeout", "correctness", "cheating", "infra")
assert set(OUTCOMES) == {"passed", *ERROR_CLASSES}, "a new error class needs a place and a colour here"

COLOURS = {  # hex for matplotlib, the same names for rich
    "passed": "#2ca02c",  # green
    "extract": "#7f7f7f",  # grey: nothing to run
    "compile": "#ff7f0e",  # orange
    "runtime": "#8c564b",  # brown
    "timeout": "#9467bd",  # purple
    "correctness": "#d62728",  # red
    "cheating": "#e377c2",  # pink
    "infra": "#17becf",  # cyan: the system, not the policy
}


def step_outcomes(values: dict[str, float]) -> dict[str, float]:
    """A metrics row's attempts by outcome, in OUTCOMES order (outcomes not counted are left out)."""
    counts = {"passed": values.get(mk.VERIFIER_DONE)} | {c: values.get(mk.verifier_error(c)) for c in ERROR_CLASSES}
    return {o: counts[o] for o in OUTCOMES if counts.get(o)}
