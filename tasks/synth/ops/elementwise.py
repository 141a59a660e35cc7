"""Elementwise arithmetic: unary maps with a constant, binary ops with broadcasting, learned
per-feature bias and scale, and a masked select (`where` over a comparison of an input with a
constant; the mask is the graph's bool value).

Shape rule: the output has the operands' broadcast shape. Operands must have the same rank and, axis
by axis, equal dimensions or a size-1 one (a reduction's kept axis), so `x - x.mean(-1, keepdim=True)`
is valid and `(batch, dim) + (batch, dim_2)` is not.
"""

from __future__ import annotations

from tasks.synth.builder import Builder, broadcast
from tasks.synth.dims import ONE
from tasks.synth.graph import Node, Value
from tasks.synth.ops.base import Op, Pointwise, choose, fmt

FAMILY = "elementwise"


def _unary(name: str, template: str, label: str = "", constants: tuple = ()) -> Pointwise:
    return Pointwise(name, FAMILY, template, label, constants)


class Binary(Op):
    family = FAMILY

    def __init__(self, name: str, template: str, commutative: bool):
        self.name = name
        self.template = template
        self.commutative = commutative

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.dtype != "float32":
            return None
        y = b.operand_for(x)  # never x itself: x - x and max(x, x) are degenerate, x * x is `square`
        return b.add(self.name, [x, y], broadcast(x.shape, y.shape), x.layout)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return self.template.format(a=args[0], b=args[1])


def feature_shape(x: Value) -> tuple | None:
    """Shape of a per-feature parameter that broadcasts over x: (features,) on rows/seq, (channels, 1,
    ...) on signal/image; None when that axis has size 1."""
    if x.layout in ("rows", "seq"):
        d = x.shape[-1]
        return None if d == ONE else (d,)
    d = x.shape[1]
    return None if d == ONE else (d,) + (ONE,) * (len(x.shape) - 2)


class FeatureParam(Op):
    """x + bias or x * scale with a learned per-feature parameter."""

    family = FAMILY

    def __init__(self, name: str, symbol: str, prefix: str, init: str):
        self.name = name
        self.symbol = symbol
        self.module_prefix = prefix
        self.init_expr = init  # "0.1 * torch.randn({shape})"

    def build(self, b: Builder, x: Value) -> Value | None:
        shape = feature_shape(x)
        if shape is None:
            return None
        return b.add(self.name, [x], x.shape, x.layout, param_shape=shape)

    def params(self, node: Node) -> list[tuple]:
        return [node.attr("param_shape")]

    def init(self, node: Node, module: str, dim) -> list[str]:
        shape = ", ".join(dim(d) for d in node.attr("param_shape"))
        return [f"self.{module} = nn.Parameter({self.init_expr.format(shape=shape)})"]

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"{args[0]} {self.symbol} self.{module}"

    def describe(self, node: Node, args: list[str], dim) -> str:
        shape = ", ".join(dim(d) for d in node.attr("param_shape"))
        return f"{self.name}({args[0]}, learned parameter of shape ({shape}))"


class Greater(Op):
    """The comparison inside `where`: a bool mask (never sampled on its own)."""

    name = "gt"
    family = FAMILY
    sampled = False

    def build(self, b: Builder, x: Value) -> Value | None:
        return None

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"{args[0]} > {fmt(node.attr('threshold'))}"


class Where(Op):
    """m = s > t (bool), out = where(m, x, z): a masked select, two nodes.

    The mask compares a graph input s with a constant, never a computed value: a correct kernel
    reproduces an input bit for bit, while a computed value may differ in its last bits and flip the
    comparison, and with it the output, by far more than any tolerance."""

    name = "where"
    family = FAMILY
    node_count = 2

    def build(self, b: Builder, x: Value) -> Value | None:
        if x.dtype != "float32":
            return None
        sources = [b.graph.values[i] for i in b.graph.inputs if broadcast(x.shape, b.graph.values[i].shape)]
        s = b.pick(sources, lambda: b.new_input(x.shape, x.layout))
        mask = b.add(
            "gt", [s], broadcast(x.shape, s.shape), x.layout, dtype="bool", threshold=choose(b.rng, (0.0, 0.5, -0.5))
        )
        z = b.pick(
            [v for v in b.floats() if v.id != x.id and broadcast(mask.shape, v.shape)],
            lambda: b.new_input(mask.shape, x.layout),
        )
        return b.add(self.name, [mask, x, z], broadcast(mask.shape, z.shape), x.layout)

    def forward(self, node: Node, args: list[str], module: str, dim) -> str:
        return f"torch.where({args[0]}, {args[1]}, {args[2]})"


OPS = [
    _unary("scale", "{x} * {c}", "factor", (0.5, 2.0, -1.5, 0.125, 3.0)),
    _unary("shift", "{x} + {c}", "offset", (0.5, -0.25, 1.0, -1.0)),
    _unary("abs", "torch.abs({x})"),
    _unary("square", "{x} * {x}"),
    _unary(
        "clamp", "torch.clamp({x}, min={lo}, max={hi})", "range", ((-1.0, 1.0), (-0.5, 2.0), (0.0, 6.0), (-2.0, 0.5))
    ),
    Binary("add", "{a} + {b}", commutative=True),
    Binary("sub", "{a} - {b}", commutative=False),
    Binary("mul", "{a} * {b}", commutative=True),
    Binary("maximum", "torch.maximum({a}, {b})", commutative=True),
    Binary("minimum", "torch.minimum({a}, {b})", commutative=True),
    FeatureParam("bias_add", "+", "bias", "0.1 * torch.randn({shape})"),
    FeatureParam("feature_scale", "*", "scale", "1.0 + 0.1 * torch.randn({shape})"),
    Greater(),
    Where(),
]
