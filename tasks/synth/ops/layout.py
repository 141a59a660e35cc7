"""Layout ops that connect the other families: transpose between (B, S, D) and (B, C, L) views, flatten
(an image's (C, H, W) into features, or its (H, W) into a length) and concatenation.

Shape rules:
    transpose   seq (B, S, D) <-> signal (B, D, S)
    flatten     image (N, C, H, W) -> rows (N, C*H*W) or signal (N, C, H*W); signal (N, C, L) -> rows (N, C*L)
    concat      rows/seq along the features axis, signal/image along the channels: the operands agree
                on every other axis; the result's axis is the sum of theirs
Layout ops move data but compute nothing, so they do not count towards a task's level.
"""

from __future__ import annotations

from math import prod

from tasks.synth.builder import Builder
from tasks.synth.dims import Sum
from tasks.synth.dims import prod as flat
from tasks.synth.graph import Node, Value
from tasks.synth.ops.base import Op, choose

FAMILY = "layout"


class Transpose(Op):
    name = "transpose"
    family = FAMILY
    layouts = ("seq", "signal")

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout not in self.layouts:
            return None
        layout = "signal" if x.layout == "seq" else "seq"
        return b.add(self.name, [x], (x.shape[0], x.shape[2], x.shape[1]), layout)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"{args[0]}.transpose(1, 2)"

    def flops(self, node: Node, shape) -> int:
        return 0


class Flatten(Op):
    name = "flatten"
    family = FAMILY
    layouts = ("signal", "image")

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout not in self.layouts:
            return None
        start = choose(b.rng, (1, 2)) if x.layout == "image" else 1
        shape = x.shape[:start] + (flat(x.shape[start:]),)
        return b.add(self.name, [x], shape, "rows" if start == 1 else "signal", start=start)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"torch.flatten({args[0]}, {node.attr('start')})"

    def flops(self, node: Node, shape) -> int:
        return 0


class Concat(Op):
    name = "concat"
    family = FAMILY

    def build(self, b: Builder, x: Value) -> Value | None:
        axis = len(x.shape) - 1 if x.layout in ("rows", "seq") else 1

        def fits(v: Value) -> bool:
            return (
                v.id != x.id
                and v.layout == x.layout
                and len(v.shape) == len(x.shape)
                and all(d == e for i, (d, e) in enumerate(zip(v.shape, x.shape, strict=True)) if i != axis)
            )

        def fresh() -> Value:
            extent = b.new_var("features" if axis == len(x.shape) - 1 else "channels")
            return b.new_input(x.shape[:axis] + (extent,) + x.shape[axis + 1 :], x.layout)

        y = b.pick([v for v in b.floats() if fits(v)], fresh)
        shape = x.shape[:axis] + (Sum((x.shape[axis], y.shape[axis])),) + x.shape[axis + 1 :]
        return b.add(self.name, [x, y], shape, x.layout, axis=axis)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"torch.cat([{args[0]}, {args[1]}], dim={node.attr('axis')})"

    def flops(self, node: Node, shape) -> int:
        return prod(shape(node.out))


OPS = [Transpose(), Flatten(), Concat()]
