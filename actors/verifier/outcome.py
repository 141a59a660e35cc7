"""What one execution of a candidate established, and how the sandbox's replies add to it.

`RunOutcome` is the record runner.py fills and verifier.py turns into a VerifyResult: the trials,
the findings (`violations`), the figures and the stage reached. Its methods are the rules by which
what the sandbox said or did becomes part of it: a reply's error or patched comparison functions
(`absorb`), the evidence the seal wrote as it refused (`absorb_evidence`), shared mappings seen from
outside (`inspect`), a sandbox that crashed, hung, forged or exited (`sandbox_failed`), and the rule
that any finding makes the verdict cheating (`finish`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.verifier.executor import ChildSession, SandboxCrash, SandboxFailure, SandboxForged
from actors.verifier.families import ALL, NORMAL, SENSITIVITY
from actors.verifier.legality import Violation


@dataclass
class TrialRecord:
    label: str  # "primary#0", "alt1#0", "offset#0", "sensitivity#0" (families.labels)
    shapes: str
    passed: bool
    message: str = ""
    max_abs_error: float = 0.0

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "shapes": self.shapes,
            "passed": self.passed,
            "message": self.message,
            "max_abs_error": self.max_abs_error if self.max_abs_error == self.max_abs_error else None,
        }


@dataclass
class FamilyRecord:
    """What one input family (families.py) contributed to a run: its trials with their parameters and
    whether their reference output was degenerate, and the draws it skipped (never scored)."""

    family: str
    trials: list[dict] = field(default_factory=list)  # label, params; notes, degenerate, allowance where any
    skipped: list[dict] = field(default_factory=list)  # params, why, notes

    def to_json(self) -> dict:
        return {"family": self.family, "trials": self.trials, "skipped": self.skipped}


@dataclass
class RunOutcome:
    """What execution established; `verifier.py` turns it into a VerifyResult."""

    stage: str = "run"
    error_class: str | None = None
    message: str = ""  # runtime/timeout/infra explanation
    trials: list[TrialRecord] = field(default_factory=list)
    planned: int = 0  # trials the run set out to judge (plan.py, less family trials it skipped)
    violations: list[Violation] = field(default_factory=list)
    candidate_s: float | None = None
    eager_s: float | None = None
    compile_s: float | None = None
    timing_runs: int = 0
    timing: dict = field(default_factory=dict)  # the protocol's figures for both sides, the checked calls
    implausible: str = ""  # why the measured time earns no speed bonus ("" when it does)
    params: str = ""
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    sandbox: dict = field(default_factory=dict)  # the jail report of the sandbox that ran it
    exit: dict = field(default_factory=dict)  # the sandbox's own exit status
    limits: dict = field(default_factory=dict)  # the memory and time limits it ran under (limits.py)
    broken_task: bool = False  # the reference produced NaN from finite inputs
    profile: dict = field(default_factory=dict)  # a slow pass's kernels by time (profile.py): feedback only
    provenance: dict = field(default_factory=dict)  # whose code did the work, per evidence source (provenance.py)
    precompute: dict = field(default_factory=dict)  # ATen's elements computed before the first input, and the budget
    families: dict[str, FamilyRecord] = field(default_factory=dict)  # by family name (diagnostics.families)

    @property
    def q(self) -> float:
        """The share of the planned trials verified correct: trials a runtime error or a timeout kept
        the run from reaching count as not passed, so stopping early scores as failing them."""
        total = max(self.planned, len(self.trials))
        return sum(t.passed for t in self.trials) / total if total else 0.0

    def family_trial(
        self, family: str, label: str, params: dict, notes: list[str], degenerate: str, allowance: list | None
    ) -> None:
        record = self.families.setdefault(family, FamilyRecord(family))
        entry = {"label": label, "params": params}
        if notes:
            entry["notes"] = list(notes)
        if degenerate:
            entry["degenerate"] = degenerate
        if allowance:
            entry["allowance"] = [float(f"{a:.3g}") for a in allowance]
        record.trials.append(entry)

    def family_skipped(self, family: str, params: dict, why: str, notes: list[str]) -> None:
        record = self.families.setdefault(family, FamilyRecord(family))
        record.skipped.append({"params": params, "why": why, **({"notes": notes} if notes else {})})

    def families_json(self) -> list[dict]:
        """Every family the run drew from, in a fixed order (the plain draws, the families, the
        sensitivity trial)."""
        order = [NORMAL, *ALL, SENSITIVITY]
        return [self.families[f].to_json() for f in sorted(self.families, key=order.index)]

    def inspect(self, child: ChildSession) -> None:
        """What the verifier sees of the sandbox from outside: shared mappings that appeared after it
        started (memory a file descriptor and a tensor both see: Python reads it without torch)."""
        new = child.new_shared_mappings()
        if new:
            self.violations.append(
                Violation(
                    "shared_memory",
                    f"a shared memory mapping ({len(new)} new)",
                    "",
                    "tensor memory that Python reads and writes outside PyTorch: compute in your own kernel",
                )
            )
            child.baseline_maps |= set(new)  # said once

    def absorb(self, reply: dict, doing: str) -> bool:
        """Record the error of a reply; False when the job cannot go on."""
        patched = reply.get("patched")
        if isinstance(patched, list) and patched:
            self.violations.append(
                Violation(
                    "patched", ", ".join(str(p)[:40] for p in patched[:5]), "", "replacing torch's comparison functions"
                )
            )
        if reply.get("ok") and reply.get("raised") and reply.get("failure"):
            self.stage, self.error_class = "run", "runtime"
            where = f" at {reply['where']}" if reply.get("where") else ""
            self.message = f"{str(reply['failure'])[:1000]} while {doing}{where}"
            return False
        if reply.get("ok"):
            if reply.get("failure") and doing == "importing the module":
                self.stage, self.error_class = "run", "runtime"
                where = f" at {reply['where']}" if reply.get("where") else ""
                self.message = f"{str(reply['failure'])[:1000]} while {doing}{where}"
                return False
            if reply.get("failure") and doing.startswith("constructing"):
                self.stage, self.error_class = "run", "runtime"
                where = f" at {reply['where']}" if reply.get("where") else ""
                self.message = f"{str(reply['failure'])[:1000]} while {doing}{where}"
                return False
            return True
        self.stage, self.error_class = "run", "runtime"
        self.message = f"the sandbox could not answer while {doing}: {str(reply.get('error', ''))[:300]}"
        return False

    def absorb_evidence(self, child: ChildSession) -> None:
        """What the fence and the audit hook wrote to the evidence pipe the moment they refused: it holds
        whatever the candidate did afterwards."""
        child.drain_evidence()
        known = {(v.kind, v.what) for v in self.violations}
        for v in child.evidence:
            if (v.kind, v.what) not in known:
                self.violations.append(v)
                known.add((v.kind, v.what))
        child.evidence.clear()

    def finish(self) -> None:
        """Any finding makes the verdict cheating, whatever else happened (unless the system failed)."""
        if self.violations and self.error_class != "infra":
            self.stage, self.error_class = "legality", "cheating"

    def sandbox_failed(self, err: SandboxFailure, doing: str, limit_s: float) -> None:
        """A sandbox that crashed, hung, forged a reply or exited while `doing`: a finding where it
        was the candidate's doing, else the failure's own class."""
        if isinstance(err, SandboxCrash) and err.exited_cleanly:
            self.violations.append(
                Violation(
                    "exit",
                    "the process exited with status 0 during " + doing,
                    "",
                    "os._exit / exit to fake a finished run",
                )
            )
        if isinstance(err, SandboxForged):
            self.violations.append(Violation("forged", str(err), "", "writing to the verifier's channel"))
        if self.violations:
            self.stage, self.error_class = "legality", "cheating"
            self.message = f"{err} ({doing})"
            return
        self.error_class = err.error_class
        if err.error_class == "timeout":
            self.message = (
                f"execution exceeded the {limit_s:g} s limit during {doing}: "
                "an endless loop, a deadlock, or far too slow"
            )
        else:
            self.message = f"while {doing}, {err}"
        self.stage = "performance" if self.stage == "performance" else "run"


def aliasing(output: int) -> Violation:
    """The finding for an output that shares memory with an input of its call: a view of the input,
    or the input written in place and returned, is no output computed by the candidate's kernel."""
    return Violation(
        "output_aliases_input",
        f"output {output} shares memory with an input",
        "",
        "outputs must be fresh tensors your kernel wrote, not views of (or writes into) the inputs",
    )


def precompute_finding(elements: int, budget: int, per_parameter: int, floor: int) -> Violation:
    """The finding for ATen compute before the first input beyond the task's budget (PRECOMPUTE_*)."""
    return Violation(
        "precomputed",
        f"ATen computed {elements} elements before the first input (the budget is {budget}: "
        f"{per_parameter}x the task's parameters and buffers, plus {floor})",
        "",
        "a table of answers made by PyTorch before any input is not your kernel's work: compute constants "
        "with your own kernel, or in forward",
    )
