"""What the policy is asked, as chat messages (docs/rollout.md). The turn policy
(actors/rollout/turns.py) assembles them into a conversation; the tokenizer's chat template renders it.

A kernel task opens with a system message holding the rules (`ModelNew`, no fallback, one fenced
file) and a user message holding the task: the reference code, its shapes and dtypes (read
statically from the reference's module constants, never by running it) and the backend. A
non-kernel task's user message is its payload's "prompt" (and its system message its payload's
"system", when it has one). Later user messages are the verifier's feedback on the previous answer:
a repair request after a failure, an optimisation request after a pass that was slow. The learner's
warm start trains on the same opening.
"""

from __future__ import annotations

import ast
import re

from actors.policy.tokenizer import Message
from protocols import Task, VerifyResult
from protocols.pyparse import parse_python

BACKEND_TEXT = {
    "cuda": "CUDA C++ kernels compiled with torch.utils.cpp_extension.load_inline (nvcc)",
    "cpu": "C++ kernels compiled with torch.utils.cpp_extension.load_inline (g++)",
    "musa": "MUSA kernels compiled with torch_musa's extension loader (mcc)",
}

RULES = (
    "You write fast native kernels for PyTorch programs. Write a class `ModelNew(nn.Module)` with the "
    "same constructor arguments and forward() signature as `Model`, returning the same outputs. Its "
    "forward() must compute with your own native kernels: calling PyTorch/ATen compute (torch.*, F.*, "
    "tensor math) inside forward() is a fallback and scores -1; only tensor plumbing (empty, view, "
    "reshape, contiguous) is allowed. Do not import the reference. Answer with one complete Python file "
    "in a ```python fenced block."
)

_DTYPE = re.compile(r"\btorch\.(float16|bfloat16|float32|float64|half|float|int8|int32|int64|bool)\b")


def shape_summary(reference: str, backend: str) -> str:
    """Module-level size constants (with KILN_CPU_SHAPES applied on cpu) and the dtypes mentioned."""
    try:
        tree = parse_python(reference)
    except SyntaxError:
        return "constants: see the reference"
    sizes: dict[str, object] = {}
    cpu_sizes: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if name == "KILN_CPU_SHAPES" and isinstance(value, dict):
                cpu_sizes = value
            elif not name.startswith("KILN_") and isinstance(value, (int, float, tuple, list)):
                sizes[name] = value
    if backend == "cpu":
        sizes.update(cpu_sizes)
    dtypes = sorted(set(_DTYPE.findall(reference))) or ["float32"]
    listed = ", ".join(f"{k} = {v}" for k, v in sizes.items()) or "see the reference"
    return f"constants (sizes, parameters): {listed}; dtypes: {', '.join(dtypes)}"


def opening(task: Task) -> list[Message]:
    """The messages every conversation about `task` starts with: the rules and the task.
    Raises ValueError for a task this code cannot pose (a non-kernel task without a prompt)."""
    if task.kind != "kernel":
        prompt = task.payload.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"task {task.task_id} of kind {task.kind!r} has no payload['prompt']")
        system = task.payload.get("system")
        return ([Message("system", system)] if isinstance(system, str) and system else []) + [Message("user", prompt)]
    k = task.kernel
    text = (
        f"Task {k.name} (level {k.level}). Make this PyTorch reference faster with {BACKEND_TEXT[k.backend]}.\n"
        f"Backend: {k.backend}. Module {shape_summary(k.reference, k.backend)}.\n\n"
        f"Reference:\n```python\n{k.reference.rstrip()}\n```\n"
    )
    return [Message("system", RULES), Message("user", text)]


def repair_request(task: Task, feedback: str) -> str:
    """The user's message after a failed answer: the verifier's feedback and what to do about it."""
    if task.kind != "kernel":
        return feedback.strip()
    return (
        f"The verifier rejected this answer.\n{feedback.strip()}\nFix it and answer with the complete corrected file."
    )


def optimize_request(task: Task, verdict: VerifyResult, until: float | None = None) -> str:
    """The user's message after an answer that passed but was slower than wanted (a performance turn):
    its speedup, the verifier's timing feedback (the candidate's time and each baseline's), and the
    speedup over eager it has to beat (`until`, when known); for a non-kernel task, the reward actor's
    feedback alone (as a repair request)."""
    if task.kind != "kernel":
        return verdict.feedback.strip()
    speed = f"{verdict.speedup_eager:.2f}x" if verdict.speedup_eager is not None else "not measured"
    target = f" Aim for a speedup of at least {until:.2f}x." if until else ""
    return (
        f"The kernel is correct and legal, but slow: its speedup over eager PyTorch is {speed}.{target}\n"
        f"{verdict.feedback.strip()}\n"
        "Make it faster (fuse work, improve memory access, use vectorised loads) and answer with the "
        "complete file."
    )


def elision_note(left_out: int) -> str:
    """Appended to the task's message when earlier turns of the dialogue are not shown."""
    turns = "turn" if left_out == 1 else "turns"
    return (
        f"\n\n(Your {left_out} earlier {turns} at this task and the feedback on them are left out here; "
        "your most recent answer and its feedback follow.)"
    )
