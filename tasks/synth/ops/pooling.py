"""Pooling: max and average pooling over the length of signal values and the height and width of image
values, and global average pooling of images.

Shape rules (kernel k in 2..4, stride s = k, 1 or 2, padding p <= k // 2 as PyTorch requires):
    max_pool1d, avg_pool1d   (N, C, L)    -> (N, C, window(L))
    max_pool2d, avg_pool2d   (N, C, H, W) -> (N, C, window(H), window(W))
    adaptive_avg_pool2d      (N, C, H, W) -> (N, C, 1, 1)
A pooled axis must not have size 1, and the output length must be at least 1 in every environment.
"""

from __future__ import annotations

from math import prod

from tasks.synth.builder import Builder
from tasks.synth.dims import ONE, window
from tasks.synth.graph import Node, Value
from tasks.synth.ops.base import Op, choose, non_one

FAMILY = "pooling"


class Pool(Op):
    family = FAMILY

    def __init__(self, name: str, function: str, spatial: int):
        self.name = name
        self.function = function  # "F.max_pool2d"
        self.spatial = spatial
        self.layouts = ("signal",) if spatial == 1 else ("image",)

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout not in self.layouts or not non_one(*x.shape[2:]):
            return None
        k = choose(b.rng, (2, 3, 4))
        s = choose(b.rng, (k, k, 1, 2))
        p = choose(b.rng, (0, 0, k // 2))
        shape = x.shape[:2] + tuple(window(n, k, s, p) for n in x.shape[2:])
        return b.add(self.name, [x], shape, x.layout, kernel=k, stride=s, padding=p)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return (
            f"{self.function}({args[0]}, kernel_size={node.attr('kernel')}, stride={node.attr('stride')}, "
            f"padding={node.attr('padding')})"
        )

    def flops(self, node: Node, shape) -> int:
        return prod(shape(node.out)) * node.attr("kernel") ** self.spatial


class GlobalAvgPool(Op):
    name = "adaptive_avg_pool2d"
    family = FAMILY
    layouts = ("image",)

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout != "image" or not non_one(*x.shape[2:]):
            return None
        return b.add(self.name, [x], x.shape[:2] + (ONE, ONE), "image")

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"F.adaptive_avg_pool2d({args[0]}, 1)"

    def flops(self, node: Node, shape) -> int:
        return prod(shape(node.inputs[0]))


OPS = [
    Pool("max_pool1d", "F.max_pool1d", 1),
    Pool("avg_pool1d", "F.avg_pool1d", 1),
    Pool("max_pool2d", "F.max_pool2d", 2),
    Pool("avg_pool2d", "F.avg_pool2d", 2),
    GlobalAvgPool(),
]
