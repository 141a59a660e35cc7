"""The embedded engine's prefix cache: keys and values of contexts it has computed, kept for the rows
that extend them, so that a context's shared beginning is prefilled once.

Two rows meet it in a run:
- the later attempts of a task group, admitted in another cycle than the first ones: the same prompt
  (attempts admitted together already share one prefill: static_batch.fill);
- a dialogue's next turn (a repair or performance turn): its prompt is the dialogue so far, whose
  beginning is the previous turn's context (the chat template renders it again, so the two agree on a
  prefix, not necessarily on every token: the match is the longest common prefix).

The keys and values of position i depend only on the tokens up to i, so any common prefix of a cached
context and a new one holds exactly the keys and values the new one would compute there (under the
same weights: a weight update empties the cache, `clear`). A pure container: which tensors to keep and
where to write them is static_batch.fill's and the engine's.

Bounded by `budget` tokens, least recently used first out. A lookup compares the new context with
every entry (numpy, one pass each): entries are few (the budget is a few contexts' worth).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# A shared prefix shorter than this is prefilled with the rest: its copy would cost about what it saves.
MIN_SHARED = 16


@dataclass
class Entry:
    tokens: np.ndarray  # int64 [n]
    keys: list[torch.Tensor]  # per layer [kv_heads, n, head_dim], in the slots' dtype
    values: list[torch.Tensor]
    logits: torch.Tensor | None  # [vocab]: the next token's logits after all n tokens (None: not kept)
    used: int = 0


@dataclass
class PrefixCache:
    budget: int  # tokens kept at most over all entries; 0 turns the cache off
    entries: dict[bytes, Entry] = field(default_factory=dict)
    tick: int = 0
    held: int = 0  # tokens in the entries
    hits: int = 0  # lookups that found a shared prefix
    shared: int = 0  # tokens those lookups did not prefill again

    def match(self, context: list[int]) -> tuple[Entry, int] | None:
        """The entry sharing the longest prefix with `context`, and that prefix's length (at least
        MIN_SHARED tokens); None when none does."""
        if not self.entries or len(context) < MIN_SHARED:
            return None
        ctx = np.asarray(context, dtype=np.int64)
        best, longest = None, MIN_SHARED - 1
        for entry in self.entries.values():
            n = min(len(entry.tokens), len(ctx))
            if n <= longest:
                continue
            differ = np.flatnonzero(entry.tokens[:n] != ctx[:n])
            common = int(differ[0]) if differ.size else n
            if common > longest:
                best, longest = entry, common
        if best is None:
            return None
        self.tick += 1
        best.used = self.tick
        self.hits += 1
        self.shared += longest
        return best, longest

    def put(
        self,
        tokens: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        logits: torch.Tensor | None,
    ) -> None:
        """Keep a copy of a context's keys and values (`keys[l]` [kv_heads, n, head_dim] for the n
        tokens), then drop the least recently used entries until the budget holds."""
        n = len(tokens)
        if self.budget <= 0 or n < MIN_SHARED or n > self.budget:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        key = arr.tobytes()
        self.tick += 1
        if key in self.entries:
            self.entries[key].used = self.tick
            if logits is not None and self.entries[key].logits is None:
                self.entries[key].logits = logits.detach().clone()
            return
        self.entries[key] = Entry(
            arr,
            [k.detach().clone() for k in keys],
            [v.detach().clone() for v in values],
            None if logits is None else logits.detach().clone(),
            self.tick,
        )
        self.held += n
        while self.held > self.budget:
            oldest = min(self.entries, key=lambda k: self.entries[k].used)
            self.held -= len(self.entries.pop(oldest).tokens)

    def clear(self) -> None:
        """Forget every entry (new weights: the keys and values were computed with the old ones)."""
        self.entries.clear()
        self.held = 0
