"""An example task-source plug-in: small text tasks that a tiny byte-level model can learn in minutes.

Use it with `replay.task_source: actors.buffer.examples.TextMatchTasks`. Tasks are of kind
"text_match" (never posing as kernel tasks) with payload {"prompt": str, "answer": str}; the matching
reward actor scores s = 1 on an exact match of the stripped response, with partial credit below.

The set is a fixed function of this code (its own seeded generator), not of the run's seeds, so a
task id always means the same prompt; the run's `split_seed` only decides which ids are held out.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from configs import ReplayConfig
from protocols import Task

KIND = "text_match"
WORDS_PER_FAMILY = 100
_GENERATOR_SEED = 20261122

# family name -> (instruction, transformation); each is checkable by exact string comparison
FAMILIES = {
    "repeat": ("Repeat", lambda w: w),
    "reverse": ("Reverse", lambda w: w[::-1]),
    "upper": ("Uppercase", str.upper),
}


def three_letter_words(n: int, seed: int) -> list[str]:
    """n distinct lowercase 3-letter strings, in a seeded order."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def word_tasks(
    kind: str, prefix: str, families: dict[str, tuple[str, Callable[[str], str]]], words: list[str]
) -> list[Task]:
    """One task of `kind` per (family, word): prompt "<instruction>: <word>", answer the family's
    transformation of the word, id "<prefix>/<family>/<word>" (the example task sources share this)."""
    return [
        Task(
            task_id=f"{prefix}/{family}/{word}",
            kind=kind,
            payload={"prompt": f"{instruction}: {word}\n", "answer": transform(word)},
        )
        for family, (instruction, transform) in families.items()
        for word in words
    ]


class TextMatchTasks:
    """300 tasks: "Repeat: abc" -> "abc", "Reverse: abc" -> "cba", "Uppercase: abc" -> "ABC"."""

    def __init__(self, cfg: ReplayConfig, backend: str) -> None:
        self.words = three_letter_words(WORDS_PER_FAMILY, _GENERATOR_SEED)

    def tasks(self) -> list[Task]:
        return word_tasks(KIND, "text", FAMILIES, self.words)
