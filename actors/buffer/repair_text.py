"""An example task source for multi-turn repair: short text tasks whose verifier feedback names the
faulty positions but not the answer (actors/verifier/repair_text.py scores them).

Use it with `replay.task_source: actors.buffer.repair_text.RepairTextTasks`. Tasks are of kind
"repair_text" with payload {"prompt": str, "answer": str}:

    "Reverse: abc" -> "cba"     "Sort: cab" -> "abc"     "Min: cab" -> "a"     "Max: cab" -> "c"

Reverse and Sort answers are three letters, so a wrong first answer usually has some right positions
for a repair turn to keep. Min and Max answers are one letter, which an untrained byte-level model hits
by chance about once in 26 tries once it writes lowercase letters (1 in 259 before): early passes, whose
extra output makes them slow, are what the performance turns act on in a short run.
`task_source_args: {families: [reverse, sort]}` keeps a subset.

The set is a fixed function of this code (its own seeded generator), not of the run's seeds, so a task
id always means the same prompt; the run's `split_seed` only decides which ids are held out.
"""

from __future__ import annotations

from actors.buffer.examples import three_letter_words, word_tasks
from configs import ReplayConfig
from protocols import Task

KIND = "repair_text"
WORDS_PER_FAMILY = 100
_GENERATOR_SEED = 20261126

# family name -> (instruction, transformation)
FAMILIES = {
    "reverse": ("Reverse", lambda w: w[::-1]),
    "sort": ("Sort", lambda w: "".join(sorted(w))),
    "min": ("Min", min),
    "max": ("Max", max),
}


class RepairTextTasks:
    """100 tasks per family (400 with all four families)."""

    def __init__(self, cfg: ReplayConfig, backend: str, *, families: list[str] | None = None) -> None:
        chosen = list(FAMILIES) if families is None else list(families)
        unknown = sorted(set(chosen) - set(FAMILIES))
        if unknown or not chosen:
            raise ValueError(f"families must be a non-empty subset of {sorted(FAMILIES)}, got {chosen}")
        self.families = chosen
        self.words = three_letter_words(WORDS_PER_FAMILY, _GENERATOR_SEED)

    def tasks(self) -> list[Task]:
        return word_tasks(KIND, KIND, {f: FAMILIES[f] for f in self.families}, self.words)
