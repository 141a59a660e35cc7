"""The graph under construction, as ops see it while they insert themselves.

An op's `build` asks the builder for new size constants, fresh graph inputs or existing values to
use as operands, then adds its node(s). The sampler takes a `mark()` before each attempt and
`rollback`s it when the op declines or leaves a shape invalid in some environment, so a failed
attempt leaves no constant, input or node behind.
"""

from __future__ import annotations

from random import Random

from tasks.synth.dims import ONE, Dim, Var
from tasks.synth.graph import Graph, Node, Value


def broadcast(a: tuple, b: tuple) -> tuple | None:
    """The broadcast shape of two same-rank shapes whose dims are equal or ONE; None otherwise."""
    if len(a) != len(b):
        return None
    out = []
    for x, y in zip(a, b, strict=True):
        if x == y or y == ONE:
            out.append(x)
        elif x == ONE:
            out.append(y)
        else:
            return None
    return tuple(out)


class Builder:
    def __init__(self, rng: Random):
        self.rng = rng
        self.graph = Graph()

    # ------------------------------------------------------------------ transactions

    def mark(self) -> tuple[int, int, int, int]:
        g = self.graph
        return len(g.sizes.vars), len(g.values), len(g.inputs), len(g.nodes)

    def rollback(self, mark: tuple[int, int, int, int]) -> None:
        n_vars, n_values, n_inputs, n_nodes = mark
        g = self.graph
        g.sizes.truncate(n_vars)
        del g.values[n_values:], g.inputs[n_inputs:], g.nodes[n_nodes:]

    # ------------------------------------------------------------------ sizes and values

    def new_var(self, role: str) -> Var:
        return self.graph.sizes.new(role, self.rng)

    def new_groups(self, channels: Dim) -> Var:
        return self.graph.sizes.new_groups(channels)

    def new_input(self, shape: tuple, layout: str, dtype: str = "float32") -> Value:
        value = Value(len(self.graph.values), tuple(shape), dtype, layout)
        self.graph.values.append(value)
        self.graph.inputs.append(value.id)
        return value

    def input_of_layout(self, layout: str) -> Value:
        """A fresh graph input with new size constants for a layout's axes."""
        roles = {
            "rows": ("rows", "features"),
            "seq": ("batch", "seq", "features"),
            "signal": ("batch", "channels", "length"),
            "image": ("batch", "channels", "height", "width"),
        }
        return self.new_input(tuple(self.new_var(r) for r in roles[layout]), layout)

    def add(self, op: str, inputs: list[Value], shape: tuple, layout: str, dtype: str = "float32", **attrs) -> Value:
        value = Value(len(self.graph.values), tuple(shape), dtype, layout)
        self.graph.values.append(value)
        self.graph.nodes.append(Node(op, tuple(v.id for v in inputs), value.id, tuple(sorted(attrs.items()))))
        return value

    # ------------------------------------------------------------------ operands

    def consumed(self, value: Value) -> bool:
        return any(value.id in n.inputs for n in self.graph.nodes)

    def floats(self) -> list[Value]:
        return [v for v in self.graph.values if v.dtype == "float32"]

    def pick(self, candidates: list[Value], fresh) -> Value:
        """An operand: preferably a value nothing consumes yet (that joins a side branch back into
        the graph), else any candidate, else (and sometimes anyway) a fresh graph input."""
        open_ = [v for v in candidates if not self.consumed(v)]
        r = self.rng.random()
        if open_ and r < 0.5:
            return self.rng.choice(open_)
        if candidates and r < 0.8:
            return self.rng.choice(candidates)
        return fresh()

    def operand_for(self, x: Value) -> Value:
        """A second operand for a binary elementwise op on x: a broadcast-compatible existing value
        other than x, or a fresh input shaped like x."""
        cands = [v for v in self.floats() if v.id != x.id and broadcast(x.shape, v.shape)]
        return self.pick(cands, lambda: self.new_input(x.shape, x.layout))
