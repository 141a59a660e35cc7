"""Symbolic tensor dimensions: the size constants of a task and the expressions ops derive from them.

A synthesized task must stay valid when a caller reassigns its module-level size constants (the cpu
sizes, the alt shapes), so a tensor's shape is a tuple of expressions, not of numbers:

* `Var(i)`: size constant number i of the graph's `SizeTable` (its name is given at emission);
* `ONE`: a dimension of size 1 (a reduction's kept dimension, a global pool's output);
* `Window`: the output length of a convolution or pooling window sliding over another dimension;
* `Upsampled`: the output length of a transposed convolution;
* `Sum` (concatenation) and `Prod` (flattening).

Two dimensions are equal exactly when their expressions are equal; that is the constraint binary
elementwise ops and matmuls put on their operands. An expression is evaluated against one
assignment of the constants (`evaluate`) and rendered as Python over their names (`render`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    id: int  # index into the graph's SizeTable


@dataclass(frozen=True)
class One:
    pass


ONE = One()


@dataclass(frozen=True)
class Window:
    """floor((src + 2*padding - dilation*(kernel-1) - 1) / stride) + 1, PyTorch's conv/pool length."""

    src: Dim
    kernel: int
    stride: int
    padding: int
    dilation: int = 1


@dataclass(frozen=True)
class Upsampled:
    """(src - 1)*stride - 2*padding + dilation*(kernel-1) + output_padding + 1 (transposed conv)."""

    src: Dim
    kernel: int
    stride: int
    padding: int
    output_padding: int = 0
    dilation: int = 1


@dataclass(frozen=True)
class Sum:
    parts: tuple


@dataclass(frozen=True)
class Prod:
    parts: tuple


Dim = Var | One | Window | Upsampled | Sum | Prod


def window(src: Dim, kernel: int, stride: int = 1, padding: int = 0, dilation: int = 1) -> Dim:
    """A sliding-window output length, simplified to `src` when the window keeps the length."""
    if stride == 1 and 2 * padding == dilation * (kernel - 1):
        return src
    return Window(src, kernel, stride, padding, dilation)


def upsampled(src: Dim, kernel: int, stride: int, padding: int) -> Dim:
    if stride == 1 and 2 * padding == kernel - 1:
        return src
    return Upsampled(src, kernel, stride, padding)


def prod(parts: tuple) -> Dim:
    """The size of several dimensions flattened into one (size-1 parts dropped)."""
    kept = tuple(p for p in parts if p != ONE)
    if not kept:
        return ONE
    return kept[0] if len(kept) == 1 else Prod(kept)


def evaluate(dim: Dim, values: Mapping[int, int]) -> int:
    """The dimension's size under one assignment of the size constants (may be < 1: invalid)."""
    if isinstance(dim, Var):
        return values[dim.id]
    if isinstance(dim, One):
        return 1
    if isinstance(dim, Window):
        n = evaluate(dim.src, values)
        return (n + 2 * dim.padding - dim.dilation * (dim.kernel - 1) - 1) // dim.stride + 1
    if isinstance(dim, Upsampled):
        n = evaluate(dim.src, values)
        return (n - 1) * dim.stride - 2 * dim.padding + dim.dilation * (dim.kernel - 1) + dim.output_padding + 1
    if isinstance(dim, Sum):
        return sum(evaluate(p, values) for p in dim.parts)
    total = 1
    for p in dim.parts:
        total *= evaluate(p, values)
    return total


def _offset(expr: str, c: int) -> str:
    return expr if c == 0 else f"{expr} + {c}" if c > 0 else f"{expr} - {-c}"


def render(dim: Dim, name: Callable[[int], str]) -> str:
    """Python source computing the dimension from the size constants' names."""
    if isinstance(dim, Var):
        return name(dim.id)
    if isinstance(dim, One):
        return "1"
    if isinstance(dim, Window):
        src = _atom(dim.src, name)
        c = 2 * dim.padding - dim.dilation * (dim.kernel - 1) - 1
        if dim.stride == 1:
            return _offset(src, c + 1)
        shifted = _offset(src, c)
        return f"{shifted if c == 0 else f'({shifted})'} // {dim.stride} + 1"
    if isinstance(dim, Upsampled):
        src = _atom(dim.src, name)
        c = -dim.stride - 2 * dim.padding + dim.dilation * (dim.kernel - 1) + dim.output_padding + 1
        scaled = src if dim.stride == 1 else f"{src} * {dim.stride}"
        return _offset(scaled, c)
    if isinstance(dim, Sum):
        return " + ".join(render(p, name) for p in dim.parts)
    return " * ".join(_atom(p, name) for p in dim.parts)


def _atom(dim: Dim, name: Callable[[int], str]) -> str:
    """Render with parentheses unless the expression is a single name or number."""
    text = render(dim, name)
    return text if isinstance(dim, (Var, One)) else f"({text})"


def variables(dim: Dim) -> list[int]:
    """The size-constant ids the expression reads, in order of first appearance."""
    if isinstance(dim, Var):
        return [dim.id]
    if isinstance(dim, One):
        return []
    if isinstance(dim, (Window, Upsampled)):
        return variables(dim.src)
    out: list[int] = []
    for p in dim.parts:
        out += [v for v in variables(p) if v not in out]
    return out


def substitute(dim: Dim, mapping: Mapping[int, int]) -> Dim:
    """The same expression over renumbered size constants (pruning drops unused ones)."""
    if isinstance(dim, Var):
        return Var(mapping[dim.id])
    if isinstance(dim, One):
        return dim
    if isinstance(dim, Window):
        return Window(substitute(dim.src, mapping), dim.kernel, dim.stride, dim.padding, dim.dilation)
    if isinstance(dim, Upsampled):
        return Upsampled(
            substitute(dim.src, mapping), dim.kernel, dim.stride, dim.padding, dim.output_padding, dim.dilation
        )
    return type(dim)(tuple(substitute(p, mapping) for p in dim.parts))
