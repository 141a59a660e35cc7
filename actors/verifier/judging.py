"""A trial's outputs read and judged (the trusted side of every call a run makes).

Outputs are read back from the I/O arena as bytes of the dtype and shape the reference gives
(nothing else is read) and compared with the reference's outputs on exactly the call's inputs.
Each trial is looked at three times: the outputs as they were when forward returned (and, on cuda,
the caller's stream was synchronised), the outputs again once the device is idle (on cpu, after a
pause), and the inputs after the call. The first must match the reference; a difference between the
first two is work that outlived forward; inputs that changed were written to. A wrong output that is
bit for bit an earlier trial's correct one is a replayed result; one that did not move when the
sensitivity trial moved the reference's is named as such.
"""

from __future__ import annotations

import secrets

import torch

from actors.verifier.compare import CHUNK, compare_outputs
from actors.verifier.executor import ChildSession
from actors.verifier.families import NORMAL
from actors.verifier.legality import Violation
from actors.verifier.outcome import RunOutcome, TrialRecord, aliasing
from actors.verifier.reference import Reference, Trial
from actors.verifier.tensors import dtype_name, fingerprint, same_bytes

# cuda: a device-wide synchronize right after the caller's stream was synchronised that takes longer
# than this found work still running: work of the candidate's that outlived forward.
PENDING_S = 0.5e-3


class TrialJudge:
    """The judging of one run's trials and timed calls, with what it remembers across them."""

    def __init__(
        self, out: RunOutcome, ref: Reference, device_type: str, tol_override: tuple[float, float] | None
    ) -> None:
        self.out, self.ref, self.device_type, self.tol_override = out, ref, device_type, tol_override
        # Correct outputs' fingerprints (tensors.py; sampled at places secret to this run) -> trial.
        self.seen_outputs: dict[str, int] = {}
        self.output_prints: dict[int, str] = {}  # trial index -> the fingerprint of the candidate's output
        self.labels: dict[int, str] = {}  # trial index -> its label
        self.fingerprint_key = secrets.randbits(62)

    def judge(self, child: ChildSession, trial: Trial, reply: dict, label: str, *, counts: bool = True) -> None:
        """One trial's reply: its outputs against the reference's (recorded as a trial when `counts`),
        then the second look (work that outlived forward), its inputs after the call (written to?) and
        a wrong output that repeats an earlier trial's correct one (replayed)."""
        shapes = trial.config.describe()
        if reply.get("failure"):
            if reply.get("subclass"):
                self.out.violations.append(
                    Violation(
                        "output_type",
                        f"an output that poses as one: {str(reply['failure'])[:200]}",
                        "",
                        "outputs must be plain torch.Tensor objects in a plain tuple or list, not subclasses",
                    )
                )
            if counts:
                where = f" at {reply['where']}" if reply.get("where") else ""
                self.out.trials.append(TrialRecord(label, shapes, False, f"{str(reply['failure'])[:400]}{where}"))
            return
        aliased = reply.get("aliased")
        if type(aliased) is int and aliased >= 0:
            self.out.violations.append(aliasing(aliased))
        got, why = self.outputs(child, reply.get("outputs"), trial.expected)
        result = None
        if got is not None:
            result = compare_outputs(got, trial.expected, self.tol_override, self.ref.device, trial.allowance)
        seen = fingerprint(got, self.fingerprint_key) if got is not None else None
        # The sensitivity check: base's inputs perturbed until the reference's output moved MOVE
        # tolerance bounds, and the candidate's output is bit for bit what it was on base.
        unmoved = trial.base is not None and seen is not None and self.output_prints.get(trial.base) == seen
        if counts:
            if result is None:
                self.out.trials.append(TrialRecord(label, shapes, False, on(trial, why)))
            else:
                message = result.message
                if unmoved and not result.ok:
                    message = (
                        f"the output did not change from trial {self.labels.get(trial.base, '?')}'s, whose inputs "
                        f"these perturb, while the reference's moved {trial.drawn.params.get('moved')} tolerance "
                        f"bounds: the output must follow the inputs ({message})"
                    )
                self.out.trials.append(TrialRecord(label, shapes, result.ok, on(trial, message), result.max_abs_error))
            if seen is not None:
                self.output_prints[trial.index] = seen
        if got is None:
            return
        later, _ = self.outputs(child, reply.get("after"), trial.expected, snapshot=False)
        pending = reply.get("pending_s")
        still_running = self.device_type == "cuda" and isinstance(pending, (int, float)) and pending > PENDING_S
        if later is None or still_running or any(not same_bytes(a, b) for a, b in zip(got, later, strict=True)):
            kind = "stream_escape" if self.device_type == "cuda" else "thread_escape"
            self.out.violations.append(
                Violation(
                    kind,
                    "the outputs were still being written after forward returned",
                    "",
                    "work left running after the call escapes the output check",
                )
            )
        tensors = [x for x in trial.inputs if isinstance(x, torch.Tensor)]
        kept, _ = self.outputs(child, reply.get("inputs_after"), tensors, snapshot=False)
        # Not strict: kept is None when the child's inputs could not be read back; nothing to compare then.
        for i, (before, after) in enumerate(zip(tensors, kept or [], strict=False)):
            if not same_bytes(before, after):
                self.out.violations.append(
                    Violation(
                        "input_mutated", f"input {i} was modified in place", "", "forward must not write to its inputs"
                    )
                )
        # A wrong output that is bit for bit an earlier trial's *correct* output is a replayed result
        # (a constant or garbage output that merely repeats is only wrong, not replayed): an output
        # that ignores its inputs, right on one trial, is one on the sensitivity trial.
        earlier = self.seen_outputs.get(seen)
        if result is not None and not result.ok and earlier is not None:
            which = "the canary trial" if not counts else f"trial {label}"
            self.out.violations.append(
                Violation(
                    "replayed_output",
                    f"{which} returned exactly the output of trial {self.labels.get(earlier, earlier + 1)}",
                    "",
                    "results cached across calls",
                )
            )
        if result is not None and result.ok and counts:
            self.seen_outputs.setdefault(seen, trial.index)

    def outputs(self, child: ChildSession, entries, expected: list[torch.Tensor], *, snapshot: bool = True):
        """The outputs the sandbox placed, read as the expected dtypes and shapes (nothing else is
        read), or (None, why they cannot be). `snapshot`: copies, for outputs that are judged (the
        sandbox could rewrite the arena meanwhile); else views of the arena, for a bit-for-bit look
        at what is there now (a rewrite then shows as the difference it is). On cuda a snapshot of up
        to one comparison slice is copied straight onto the reference's device, where it is compared."""
        if not isinstance(entries, list):
            return None, "no outputs were placed"
        if len(entries) != len(expected):
            return None, f"returned {len(entries)} output(s), the reference returns {len(expected)}"
        got = []
        for i, (entry, exp) in enumerate(zip(entries, expected, strict=True)):
            name = "the output" if len(expected) == 1 else f"output {i}"
            onto = self.ref.device if snapshot and self.device_type == "cuda" and exp.numel() <= CHUNK["cuda"] else None
            t = child.arena.take(entry, exp, copy=snapshot, device=onto)
            if t is None:
                return None, describe_mismatch(name, entry, exp, self.device_type)
            got.append(t)
        return got, ""


def on(trial: Trial, message: str) -> str:
    """A trial's message, prefixed with what its inputs were where they were not a plain draw."""
    return message if trial.drawn.family == NORMAL or not message else f"on {trial.drawn.describe()}: {message}"


def describe_mismatch(name: str, entry, exp: torch.Tensor, device_type: str) -> str:
    if not isinstance(entry, list) or len(entry) < 6:
        return f"{name} could not be read"
    _, nbytes, dtype, shape, _, where = entry[:6]
    if where != device_type:
        return f"{name} is on {where}, expected {device_type}"
    if dtype != dtype_name(exp.dtype):
        return f"{name} has dtype {dtype}, expected {dtype_name(exp.dtype)}"
    if shape != list(exp.shape):
        return f"{name} has shape {tuple(shape) if isinstance(shape, list) else shape}, expected {tuple(exp.shape)}"
    return f"{name} ({nbytes} bytes) does not fit where the reference's output does"
