"""The level of a synthesized task, on Kiln's scale (tasks/README.md): level 1 elementwise maps, level 2
row reductions and normalisations, level 3 single matmuls and convolutions, level 4 fused multi-op
programs built around a contraction.

The rule, over the graph's compute ops (layout ops move data and are not counted):
    level 3  exactly one contraction (matmul/linear or conv family) and no other compute op
    level 4  a contraction together with any other compute op (an epilogue, a second contraction, ...)
    level 2  no contraction, and at least one reduction, normalisation or pooling op
    level 1  elementwise and activation ops only, however many (one fused map is still one pass)
"""

from __future__ import annotations

from dataclasses import dataclass

CONTRACTION = ("matmul", "conv")
ROW_WISE = ("reduction", "normalisation", "pooling")


@dataclass(frozen=True)
class Level:
    level: int
    reason: str  # one line for the task's docstring


def level_of(ops: list[tuple[str, str]]) -> Level:
    """Level from the graph's (op name, family) pairs, in graph order."""
    compute = [(name, fam) for name, fam in ops if fam != "layout"]
    contractions = [name for name, fam in compute if fam in CONTRACTION]
    if len(contractions) == 1 and len(compute) == 1:
        return Level(3, f"a single contraction ({contractions[0]})")
    if contractions:
        others = len(compute) - 1
        return Level(4, f"a contraction ({contractions[0]}) fused with {others} other op{'s' * (others != 1)}")
    row_wise = [name for name, fam in compute if fam in ROW_WISE]
    if row_wise:
        return Level(2, f"row-wise work ({', '.join(dict.fromkeys(row_wise))}) and no contraction")
    return Level(1, f"elementwise work only ({len(compute)} op{'s' * (len(compute) != 1)})")
