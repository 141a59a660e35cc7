"""Reductions over one or more axes: sum, mean, max, min, log-sum-exp, variance, 2-norm.

Shape rule: the reduced axes are dropped, or kept with size 1 (`keepdim=True`, so the result can
broadcast back against its input: `x - x.mean(-1, keepdim=True)`). The batch axis is never reduced,
nor an axis that already has size 1. Which axes may be reduced depends on the layout, and so does the
layout of the result:

    rows   (B, D)        D kept -> rows (B, 1)
    seq    (B, S, D)     D -> seq (B, S, 1) or rows (B, S);  S -> seq (B, 1, D) or rows (B, D)
    signal (N, C, L)     L -> rows (N, C) or signal (N, C, 1);  C kept -> signal (N, 1, L)
    image  (N, C, H, W)  H, W -> rows (N, C) or image (N, C, 1, 1);  C kept -> image (N, 1, H, W);
                         W -> signal (N, C, H)
"""

from __future__ import annotations

from math import prod

from tasks.synth.builder import Builder
from tasks.synth.dims import ONE
from tasks.synth.graph import Node, Value
from tasks.synth.ops.base import Op, choose, non_one

# layout -> (axes, keepdim, result layout)
AXES = {
    "rows": [((1,), True, "rows")],
    "seq": [((2,), True, "seq"), ((2,), False, "rows"), ((1,), True, "seq"), ((1,), False, "rows")],
    "signal": [((2,), False, "rows"), ((2,), True, "signal"), ((1,), True, "signal")],
    "image": [((2, 3), False, "rows"), ((2, 3), True, "image"), ((1,), True, "image"), ((3,), False, "signal")],
}


def reduced_shape(shape: tuple, axes: tuple[int, ...], keepdim: bool) -> tuple:
    if keepdim:
        return tuple(ONE if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def axes_text(axes: tuple[int, ...]) -> str:
    return str(axes[0]) if len(axes) == 1 else "(" + ", ".join(map(str, axes)) + ")"


class Reduction(Op):
    family = "reduction"

    def __init__(self, name: str, function: str, extra: str = "", work: int = 1):
        self.name = name
        self.function = function  # "torch.sum"
        self.extra = extra  # trailing keyword arguments, e.g. ", correction=0"
        self.work = work  # flops per input element

    def build(self, b: Builder, x: Value) -> Value | None:
        options = [o for o in AXES[x.layout] if non_one(*(x.shape[i] for i in o[0]))]
        if not options:
            return None
        axes, keepdim, layout = choose(b.rng, options)
        return b.add(self.name, [x], reduced_shape(x.shape, axes, keepdim), layout, axes=axes, keepdim=keepdim)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return (
            f"{self.function}({args[0]}, dim={axes_text(node.attr('axes'))}, "
            f"keepdim={node.attr('keepdim')}{self.extra})"
        )

    def flops(self, node: Node, shape) -> int:
        return self.work * prod(shape(node.inputs[0]))


OPS = [
    Reduction("sum", "torch.sum"),
    Reduction("mean", "torch.mean"),
    Reduction("amax", "torch.amax"),
    Reduction("amin", "torch.amin"),
    Reduction("logsumexp", "torch.logsumexp", work=3),
    Reduction("var", "torch.var", ", correction=0", work=3),
    Reduction("norm", "torch.linalg.vector_norm", work=2),
]
