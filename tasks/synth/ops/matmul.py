"""Contractions over the features axis: nn.Linear, matmul with a second operand, and matmul against a
transposed operand (x @ y^T: attention scores, or a weight given as an input).

Shape rules, for x of shape (*batch, M, K) (rows: (M, K); seq: (B, M, K)) with K not of size 1:
    linear      -> (*batch, M, N), N a new size constant (the layer's out_features)
    matmul      x @ y, y (*batch, K, N): an existing value of that shape or a fresh input with a new N
    matmul_nt   x @ y^T, y (*batch, N, K): an existing value (x itself gives a Gram matrix) or a fresh
                input with a new N
"""

from __future__ import annotations

from math import prod

from tasks.synth.builder import Builder
from tasks.synth.graph import Node, Value
from tasks.synth.ops.base import Op, non_one

FAMILY = "matmul"


class Linear(Op):
    name = "linear"
    family = FAMILY
    layouts = ("rows", "seq")
    module_prefix = "linear"

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout not in self.layouts or not non_one(x.shape[-1]):
            return None
        out = b.new_var("features")
        bias = b.rng.random() < 0.7
        return b.add(
            self.name, [x], x.shape[:-1] + (out,), x.layout, in_features=x.shape[-1], out_features=out, bias=bias
        )

    def init(self, node: Node, module: str, dim) -> list[str]:
        bias = "" if node.attr("bias") else ", bias=False"
        return [f"self.{module} = nn.Linear({dim(node.attr('in_features'))}, {dim(node.attr('out_features'))}{bias})"]

    def params(self, node: Node) -> list[tuple]:
        weight = (node.attr("out_features"), node.attr("in_features"))
        return [weight, (node.attr("out_features"),)] if node.attr("bias") else [weight]

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"self.{module}({args[0]})"

    def flops(self, node: Node, shape) -> int:
        return 2 * prod(shape(node.out)) * shape(node.inputs[0])[-1]


class Matmul(Op):
    family = FAMILY
    layouts = ("rows", "seq")

    def __init__(self, transposed: bool):
        self.transposed = transposed
        self.name = "matmul_nt" if transposed else "matmul"

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.layout not in self.layouts or not non_one(x.shape[-1]):
            return None
        k, batch = x.shape[-1], x.shape[:-2]
        contract, free = (-1, -2) if self.transposed else (-2, -1)

        def fits(v: Value) -> bool:
            # On rows, x @ y^T with y sharing x's leading axis would mix the batch into the features
            # (a (batch, batch) product); such a y must be a separate matrix.
            batch_mix = self.transposed and x.layout == "rows" and v.shape[0] == x.shape[0]
            return (
                len(v.shape) == len(x.shape)
                and v.shape[:-2] == batch
                and v.shape[contract] == k
                and non_one(v.shape[free])
                and not batch_mix
            )

        def fresh() -> Value:
            role = "seq" if x.layout == "seq" and self.transposed else "features"
            n = b.new_var(role)
            return b.new_input(batch + ((n, k) if self.transposed else (k, n)), x.layout)

        y = b.pick([v for v in b.floats() if fits(v)], fresh)
        return b.add(self.name, [x, y], x.shape[:-1] + (y.shape[free],), x.layout)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        other = f"{args[1]}.transpose(-2, -1)" if self.transposed else args[1]
        return f"torch.matmul({args[0]}, {other})"

    def flops(self, node: Node, shape) -> int:
        return 2 * prod(shape(node.out)) * shape(node.inputs[0])[-1]


OPS = [Linear(), Matmul(transposed=False), Matmul(transposed=True)]
