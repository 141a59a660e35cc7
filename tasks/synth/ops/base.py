"""What an op is to the generator: a shape rule (`build`), PyTorch source (`forward`, `init`) and a cost.

`build(b, x)` tries to apply the op with `x` as its first operand. It checks the op's validity
constraints on x (layout, dtype, no reduction over a size-1 axis, ...), chooses attributes and any
further operands through the builder, adds its node(s) and returns the new value; or it returns None
when x does not fit. The builder then checks that every shape is at least 1 in every environment.

Emission is split the way KernelBench files are written: `init` gives the `__init__` lines that
build the node's parameters (an `nn.Linear`, an `nn.Parameter`) from size constants, `forward` the
expression that computes the node's value from its operands.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from random import Random

from tasks.synth.builder import Builder
from tasks.synth.dims import ONE, Dim
from tasks.synth.graph import Node, Value, render_attr

# Render a Dim as Python over the size constants' names.
DimText = Callable[[Dim], str]
# The concrete shape of a value id in one environment.
ShapeOf = Callable[[int], tuple[int, ...]]


class Op:
    name: str = ""
    family: str = ""
    layouts: tuple[str, ...] = ("rows", "seq", "signal", "image")  # layouts `build` accepts for x
    commutative: bool = False  # operands may be swapped (the canonical hash sorts them)
    module_prefix: str = ""  # attribute prefix of the node's parameters ("linear" -> self.linear3)
    sampled: bool = True  # False for ops that only appear as part of another op's build
    node_count: int = 1  # nodes one build adds

    def build(self, b: Builder, x: Value) -> Value | None:
        raise NotImplementedError

    def forward(self, node: Node, args: list[str], module: str, dim: DimText) -> str:
        raise NotImplementedError

    def init(self, node: Node, module: str, dim: DimText) -> list[str]:
        """`__init__` lines creating the node's parameters (none by default)."""
        return []

    def affine(self, node: Node, module: str) -> list[str]:
        """Parameters to move off their default 1/0 values after construction (normalisation)."""
        return []

    def params(self, node: Node) -> list[tuple]:
        """Shapes (tuples of Dims) of the node's parameters."""
        return []

    def flops(self, node: Node, shape: ShapeOf) -> int:
        """Estimated floating-point work; elementwise by default: one per output element."""
        return prod(shape(node.out))

    def describe(self, node: Node, args: list[str], dim: DimText) -> str:
        """One line for the task's docstring, e.g. `sum(v2, dim=(2, 3), keepdim=True)`."""
        shown = [f"{k}={render_attr(v, dim)}" for k, v in node.attrs]
        return f"{self.name}({', '.join(args + shown)})"


class Pointwise(Op):
    """A unary map applied element by element, with an optional drawn constant (or (lo, hi) pair)."""

    def __init__(self, name: str, family: str, template: str, label: str = "", constants: tuple = ()):
        self.name = name
        self.family = family
        self.template = template  # "F.leaky_relu({x}, negative_slope={c})", "torch.clamp({x}, min={lo}, max={hi})"
        self.label = label  # the constant's attribute name ("negative_slope", "range")
        self.constants = constants

    def build(self, b: Builder, x: Value) -> Value | None:
        attrs = {self.label: choose(b.rng, self.constants)} if self.constants else {}
        return b.add(self.name, [x], x.shape, x.layout, **attrs)

    def forward(self, node: Node, args: list[str], module: str, dim: DimText) -> str:
        c = node.attr(self.label)
        if isinstance(c, tuple):
            return self.template.format(x=args[0], lo=fmt(c[0]), hi=fmt(c[1]))
        return self.template.format(x=args[0], c=fmt(c) if c is not None else "")


def non_one(*ds: Dim) -> bool:
    return all(d != ONE for d in ds)


def choose(rng: Random, options):
    """rng.choice over a sequence (kept in one place so every op draws the same way)."""
    return options[rng.randrange(len(options))]


def fmt(x: float) -> str:
    """A float literal as emitted: repr keeps it exact and stable across platforms."""
    return repr(float(x))
