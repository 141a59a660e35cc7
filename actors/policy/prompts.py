"""The structured prompts of an episode (DESIGN.md §5): what the policy is asked, turn by turn.

A kernel task's first prompt holds the reference code, its shapes and dtypes (read statically from
the reference's module constants, never by running it), the backend, the `ModelNew` requirement and
the no-fallback rule. A repair turn repeats the task and adds the failed code and its verifier
feedback. A served Buffered-Dynamic-Retry task (`task.repair`) starts from its repair context. A
non-kernel task's prompt is its payload's "prompt". The learner's warm start builds its
supervised examples on the same first prompt.
"""

from __future__ import annotations

import ast
import re

from protocols import Task

BACKEND_TEXT = {
    "cuda": "CUDA C++ kernels compiled with torch.utils.cpp_extension.load_inline (nvcc)",
    "cpu": "C++ kernels compiled with torch.utils.cpp_extension.load_inline (g++)",
    "musa": "MUSA kernels compiled with torch_musa's extension loader (mcc)",
}

RULES = (
    "Write a class `ModelNew(nn.Module)` with the same constructor arguments and forward() signature as "
    "`Model`, returning the same outputs. Its forward() must compute with your own native kernels: "
    "calling PyTorch/ATen compute (torch.*, F.*, tensor math) inside forward() is a fallback and scores "
    "-1; only tensor plumbing (empty, view, reshape, contiguous) is allowed. Do not import the reference. "
    "Answer with one complete Python file in a ```python fenced block."
)

_DTYPE = re.compile(r"\btorch\.(float16|bfloat16|float32|float64|half|float|int8|int32|int64|bool)\b")


def shape_summary(reference: str, backend: str) -> str:
    """Module-level size constants (with KILN_CPU_SHAPES applied on cpu) and the dtypes mentioned."""
    try:
        tree = ast.parse(reference)
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


def first_prompt(task: Task) -> str:
    if task.kind != "kernel":
        prompt = task.payload.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"task {task.task_id} of kind {task.kind!r} has no payload['prompt']")
        if task.repair is not None:
            return text_repair(prompt, task.repair.failed_code, task.repair.feedback)
        return prompt
    k = task.kernel
    text = (
        f"Task {k.name} (level {k.level}). Make this PyTorch reference faster with {BACKEND_TEXT[k.backend]}.\n"
        f"Backend: {k.backend}. Module {shape_summary(k.reference, k.backend)}.\n\n"
        f"Reference:\n```python\n{k.reference.rstrip()}\n```\n\n{RULES}\n"
    )
    if task.repair is not None:
        text += repair_section(task.repair.failed_code, task.repair.feedback)
    return text


def repair_section(failed_code: str, feedback: str) -> str:
    return (f"\nA previous attempt failed.\n```python\n{failed_code.rstrip()}\n```\n"
            f"Verifier feedback: {feedback.strip()}\nFix it and answer with the complete corrected file.\n")


def repair_prompt(task: Task, failed_response: str, feedback: str) -> str:
    """The next turn's prompt after a failed attempt (the whole task again, plus the feedback)."""
    if task.kind != "kernel":
        return text_repair(first_prompt(task), failed_response, feedback)
    return first_prompt(task) + repair_section(failed_response, feedback)


def text_repair(prompt: str, failed_response: str, feedback: str) -> str:
    """A non-kernel repair turn: the prompt, the failed answer, then the reward actor's feedback."""
    return f"{prompt}{failed_response.strip()}\nFeedback: {feedback.strip()}\n"
