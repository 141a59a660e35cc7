"""`kiln sft`'s data: read and validate the examples, drop those of evaluation tasks, split off the
held-out share, tokenize and cut to the model's length.

The held-out split is a pure function of (seed, example): the hash of the example's JSON falls below
`eval_fraction`. Adding examples to a file therefore never moves another example between the splits,
and a resumed run sees the split it started with.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

from actors.policy.chat_data import ChatExample, read_examples
from actors.policy.chat_tokens import TokenSequence, fit, tokenize_example
from launch.observe.words import plural
from launch.stages.decontam import EvalTasks


@dataclass
class SFTData:
    """The tokenized training and held-out sequences, and what was left out on the way."""

    train: list[TokenSequence]
    held_out: list[TokenSequence]
    examples: int  # valid examples read
    train_examples: int
    held_out_examples: int
    dropped: Counter = field(default_factory=Counter)  # "too long" -> sequences
    decontam: str = ""  # EvalTasks.summary()

    @property
    def train_tokens(self) -> int:
        return sum(len(s) for s in self.train)

    def summary(self) -> list[str]:
        lines = [
            (
                f"examples: {self.examples} read; {self.train_examples} train ({plural(len(self.train), 'sequence')}, "
                f"{plural(self.train_tokens, 'token')}), {self.held_out_examples} held out "
                f"({plural(len(self.held_out), 'sequence')})"
            ),
            self.decontam,
        ]
        if self.dropped["too long"]:
            too_long = plural(self.dropped["too long"], "sequence")
            lines.append(f"left out: {too_long} whose prompt alone fills model.max_seq_len")
        return lines


def is_held_out(example: ChatExample, seed: int, fraction: float) -> bool:
    if fraction <= 0:
        return False
    text = json.dumps(example.to_json(), sort_keys=True, ensure_ascii=False)
    digest = hashlib.sha256(f"{seed}\x00{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def load_sft_data(
    path,
    tokenizer,
    evaluation: EvalTasks,
    *,
    eval_fraction: float,
    seed: int,
    max_seq_len: int,
    enable_thinking: bool = False,
) -> SFTData:
    """Everything above; raises DataError (one line, naming file and line) for a bad example."""
    train: list[TokenSequence] = []
    held: list[TokenSequence] = []
    dropped: Counter = Counter()
    read = n_train = n_held = 0
    for example in read_examples(path):
        read += 1
        if evaluation.example_drop(example):
            continue
        into = held if is_held_out(example, seed, eval_fraction) else train
        n_held += into is held
        n_train += into is train
        for seq in tokenize_example(example, tokenizer, enable_thinking=enable_thinking):
            cut = fit(seq, max_seq_len)
            if cut is None:
                dropped["too long"] += 1
            else:
                into.append(cut)
    return SFTData(
        train=train,
        held_out=held,
        examples=read,
        train_examples=n_train,
        held_out_examples=n_held,
        dropped=dropped,
        decontam=evaluation.summary(),
    )
