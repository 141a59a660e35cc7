"""The canonical hash of a graph: equal for graphs that compute the same thing up to naming.

Two graphs are the same task when they apply the same ops with the same attributes to the same
structure of shapes, whatever the order in which the sampler inserted their nodes, the names of their
size constants, the order of a commutative op's operands, or the values of the sizes (sizes are the
task's parameters, not its identity). So the hash covers ops, attributes, dtypes and which axes are
shared, and not sizes.

How: every value first gets a structural key that ignores the identity of size constants; the graph
is then walked from its output, visiting a commutative op's operands in key order, and size constants
are numbered by first sight on that walk. The walk's listing, with constants renamed s0, s1, ..., is
hashed. (Operands whose keys tie are visited in argument order; a graph that differs only by such a
swap may get a second hash, which costs a missed duplicate, never a false one.)
"""

from __future__ import annotations

import hashlib

from tasks.synth import dims
from tasks.synth.graph import Graph, render_attr
from tasks.synth.ops import REGISTRY


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _attrs(attrs: tuple, render) -> str:
    return ",".join(f"{k}={render_attr(v, render)}" for k, v in attrs)


def canonical_hash(graph: Graph) -> str:
    anonymous = lambda d: dims.render(d, lambda _: "?")
    producer = {n.out: n for n in graph.nodes}
    key: dict[int, str] = {}
    for vid in graph.inputs:
        v = graph.values[vid]
        key[vid] = _digest(f"in {v.dtype} {[anonymous(d) for d in v.shape]}")
    for n in graph.nodes:
        kids = [key[i] for i in n.inputs]
        if REGISTRY[n.op].commutative:
            kids.sort()
        v = graph.values[n.out]
        key[n.out] = _digest(f"{n.op} {_attrs(n.attrs, anonymous)} {kids} {[anonymous(d) for d in v.shape]}")

    names: dict[int, str] = {}
    position: dict[int, int] = {}
    lines: list[str] = []

    def name(var: int) -> str:
        return names.setdefault(var, f"s{len(names)}")

    def render(d) -> str:
        return dims.render(d, name)

    def shape(vid: int) -> str:
        v = graph.values[vid]
        return f"({', '.join(render(d) for d in v.shape)}) {v.dtype}"

    def visit(vid: int) -> None:
        if vid in position:
            return
        node = producer.get(vid)
        if node is None:
            line = f"in {shape(vid)}"
        else:
            kids = list(node.inputs)
            if REGISTRY[node.op].commutative:
                kids.sort(key=lambda i: key[i])
            for kid in kids:
                visit(kid)
            operands = ", ".join(str(position[k]) for k in kids)
            line = f"{node.op}[{_attrs(node.attrs, render)}]({operands}) -> {shape(vid)}"
        position[vid] = len(lines)
        lines.append(line)

    visit(graph.output)
    return _digest("\n".join(lines))[:16]
