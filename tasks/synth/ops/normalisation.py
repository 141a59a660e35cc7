"""Normalisations: LayerNorm, RMSNorm, GroupNorm (nn modules with learned affine parameters, moved off
their 1/0 defaults so a kernel must apply them), softmax, log-softmax and L2 normalisation.

Shape rule: the output has the input's shape. LayerNorm and RMSNorm normalise the features axis of
rows/seq values; GroupNorm the channels of signal/image values, with a group count that divides the
channel count in every environment (a derived size constant); softmax, log-softmax and L2
normalisation act along the last axis or, on seq/signal/image values, along axis 1. The normalised
axis never has size 1 (that would make the output constant).
"""

from __future__ import annotations

from math import prod

from tasks.synth.builder import Builder
from tasks.synth.graph import Node, Value
from tasks.synth.ops.base import Op, choose, non_one

FAMILY = "normalisation"


class FeatureNorm(Op):
    """nn.LayerNorm / nn.RMSNorm over the features (last) axis of rows/seq values."""

    family = FAMILY
    layouts = ("rows", "seq")
    module_prefix = "norm"

    def __init__(self, name: str, constructor: str, affine: tuple[str, ...]):
        self.name = name
        self.constructor = constructor  # "nn.LayerNorm({d})"
        self.affine_names = affine  # ("weight", "bias")

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout not in self.layouts or not non_one(x.shape[-1]):
            return None
        return b.add(self.name, [x], x.shape, x.layout, features=x.shape[-1])

    def init(self, node: Node, module: str, dim) -> list[str]:
        return [f"self.{module} = {self.constructor.format(d=dim(node.attr('features')))}"]

    def affine(self, node: Node, module: str) -> list[str]:
        return [f"self.{module}.{p}" for p in self.affine_names]

    def params(self, node: Node) -> list[tuple]:
        return [(node.attr("features"),)] * len(self.affine_names)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"self.{module}({args[0]})"

    def flops(self, node: Node, shape) -> int:
        return 6 * prod(shape(node.out))


class GroupNorm(Op):
    name = "group_norm"
    family = FAMILY
    layouts = ("signal", "image")
    module_prefix = "norm"

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout not in self.layouts or not non_one(x.shape[1]):
            return None
        groups = b.new_groups(x.shape[1])
        return b.add(self.name, [x], x.shape, x.layout, groups=groups, channels=x.shape[1])

    def init(self, node: Node, module: str, dim) -> list[str]:
        return [f"self.{module} = nn.GroupNorm({dim(node.attr('groups'))}, {dim(node.attr('channels'))})"]

    def affine(self, node: Node, module: str) -> list[str]:
        return [f"self.{module}.weight", f"self.{module}.bias"]

    def params(self, node: Node) -> list[tuple]:
        return [(node.attr("channels"),)] * 2

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"self.{module}({args[0]})"

    def flops(self, node: Node, shape) -> int:
        return 6 * prod(shape(node.out))


class AxisNorm(Op):
    """softmax / log-softmax / L2-normalise along one axis."""

    family = FAMILY

    def __init__(self, name: str, function: str):
        self.name = name
        self.function = function  # "torch.softmax"

    def build(self, b: Builder, x: Value) -> Value | None:
        axes = [len(x.shape) - 1] + ([1] if x.layout != "rows" else [])
        axes = [a for a in axes if non_one(x.shape[a])]
        if not axes:
            return None
        return b.add(self.name, [x], x.shape, x.layout, axis=choose(b.rng, axes))

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"{self.function}({args[0]}, dim={node.attr('axis')})"

    def flops(self, node: Node, shape) -> int:
        return 4 * prod(shape(node.out))


OPS = [
    FeatureNorm("layer_norm", "nn.LayerNorm({d})", ("weight", "bias")),
    FeatureNorm("rms_norm", "nn.RMSNorm({d}, eps=1e-6)", ("weight",)),
    GroupNorm(),
    AxisNorm("softmax", "torch.softmax"),
    AxisNorm("log_softmax", "torch.log_softmax"),
    AxisNorm("l2_normalize", "F.normalize"),
]
