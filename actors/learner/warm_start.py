"""Supervised warm-start data (DESIGN.md §7, the SFT path): (prompt, reference solution) pairs turned
into `TrainBatch`es for `Trainer.sft_step`.

Each sequence is exactly what the policy will see and say in RL: the task's opening conversation
(system rules, user task) rendered by the tokenizer's chat template as the rollout renders its first
prompt, then the solution file in a ```python fenced block (what the verifier's extract stage reads)
and the token that ends an assistant turn. Only the response tokens carry loss. Only training-split
tasks with a solution file are used, so the warm start never sees a validation task's answer: the
learner asks replay, which owns the split, for the training tasks (`warm_start_batches`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from actors.policy.prompts import opening
from actors.policy.tokenizer import load_tokenizer
from configs import ModelConfig, WarmStartConfig
from protocols import Task, TrainBatch


def warm_start_batches(tasks: list[Task], cfg: WarmStartConfig, model: ModelConfig) -> tuple[list[TrainBatch], int]:
    """The warm start's batches from the training tasks and `cfg.solutions`, and how many solutions
    they hold."""
    if not cfg.solutions:
        raise ValueError("warm_start.solutions names no directory (the driver fills in its default)")
    pairs = solution_pairs(tasks, cfg.solutions)
    batches = sft_batches(pairs, load_tokenizer(model), max_seq_len=model.max_seq_len, batch_tokens=cfg.batch_tokens,
                          enable_thinking=model.enable_thinking)
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


def sft_batches(pairs: list[tuple[Task, str]], tokenizer, *, max_seq_len: int, batch_tokens: int,
                enable_thinking: bool = False) -> list[TrainBatch]:
    """Pack the pairs into batches of at most `batch_tokens` tokens (one sequence per pair; a pair
    longer than `max_seq_len` is cut at the end of its response and still trains on its start)."""
    end = tokenizer.end_of_turn_id
    sequences = []
    for task, solution in pairs:
        prompt = tokenizer.render(opening(task), enable_thinking=enable_thinking)
        response = tokenizer.encode(response_text(solution)) + ([int(end)] if end is not None else [])
        keep = max_seq_len - len(prompt)
        if keep < 1:
            continue
        sequences.append((prompt, response[:keep]))
    batches, current, size = [], [], 0
    for prompt, response in sequences:
        n = len(prompt) + len(response)
        if current and size + n > batch_tokens:
            batches.append(_pack(current))
            current, size = [], 0
        current.append((prompt, response))
        size += n
    if current:
        batches.append(_pack(current))
    return batches


def _pack(sequences: list[tuple[list[int], list[int]]]) -> TrainBatch:
    tokens, mask, lengths = [], [], []
    for prompt, response in sequences:
        tokens += prompt + response
        mask += [False] * len(prompt) + [True] * len(response)
        lengths.append(len(prompt) + len(response))
    n = len(tokens)
    return TrainBatch(
        version=0,
        episode_ids=[f"sft/{i}" for i in range(len(sequences))],
        tokens=np.asarray(tokens, dtype=np.int64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        loss_mask=np.asarray(mask, dtype=bool),
        behaviour_logprobs=np.zeros(n, dtype=np.float32),
        advantages=np.zeros(len(sequences), dtype=np.float32),
        versions=np.full(n, -1, dtype=np.int64),
    )
