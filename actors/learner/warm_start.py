"""Supervised warm-start data (docs/training.md, the SFT path): the training tasks' reference solutions as
chat examples, packed into `TrainBatch`es for `Trainer.sft_step` by the same code as `kiln sft`
(`actors.policy.chat_tokens`, `actors.learner.sft_data`).

Each example is exactly what the policy will see and say in RL: the task's opening conversation
(system rules, user task), answered by the solution file in a ```python fenced block (what the
verifier's extract stage reads); the tokenizer renders it as the rollout renders its first prompt, and
the response ends with the token that ends an assistant turn. Only the response tokens carry loss.
Only training-split tasks with a solution file are used, so the warm start never sees a validation
task's answer: the learner asks replay, which owns the split, for the training tasks
(`warm_start_batches`).
"""

from __future__ import annotations

from pathlib import Path

from actors.learner.sft_data import pack_sequences
from actors.policy.chat_data import ChatExample
from actors.policy.chat_tokens import fit, tokenize_example
from actors.policy.prompts import opening
from actors.policy.tokenizer import Message, load_tokenizer
from configs import ModelConfig, WarmStartConfig
from protocols import Task, TrainBatch


def warm_start_batches(tasks: list[Task], cfg: WarmStartConfig, model: ModelConfig) -> tuple[list[TrainBatch], int]:
    """The warm start's batches from the training tasks and `cfg.solutions`, and how many solutions
    they hold."""
    if not cfg.solutions:
        raise ValueError("warm_start.solutions names no directory (the driver fills in its default)")
    pairs = solution_pairs(tasks, cfg.solutions)
    batches = sft_batches(
        pairs,
        load_tokenizer(model),
        max_seq_len=model.max_seq_len,
        batch_tokens=cfg.batch_tokens,
        enable_thinking=model.enable_thinking,
    )
    return batches, len(pairs)


def solution_pairs(tasks: list[Task], solutions: str | Path) -> list[tuple[Task, str]]:
    """(task, solution source) for every kernel task with a solution file under `solutions`
    (`solutions/levelN/<name>.py` or `solutions/<name>.py`)."""
    root = Path(solutions)
    pairs = []
    for task in tasks:
        if task.kind != "kernel" or task.kernel is None:
            continue
        name = Path(task.kernel.source_path or task.kernel.name).name
        if not name.endswith(".py"):
            name += ".py"
        for candidate in (root / f"level{task.kernel.level}" / name, root / name):
            if candidate.is_file():
                pairs.append((task, candidate.read_text(encoding="utf-8")))
                break
    return pairs


def response_text(solution: str) -> str:
    return f"```python\n{solution.rstrip()}\n```\n"


def solution_example(task: Task, solution: str) -> ChatExample:
    """The opening conversation of `task` answered by `solution`."""
    return ChatExample(messages=(*opening(task), Message("assistant", response_text(solution))), task_id=task.task_id)


def sft_batches(
    pairs: list[tuple[Task, str]], tokenizer, *, max_seq_len: int, batch_tokens: int, enable_thinking: bool = False
) -> list[TrainBatch]:
    """Pack the pairs into batches of at most `batch_tokens` tokens (one sequence per pair; a pair
    longer than `max_seq_len` is cut at the end of its response and still trains on its start)."""
    sequences = []
    for task, solution in pairs:
        for seq in tokenize_example(solution_example(task, solution), tokenizer, enable_thinking=enable_thinking):
            cut = fit(seq, max_seq_len)
            if cut is not None:
                sequences.append(cut)
    return pack_sequences(sequences, batch_tokens)
