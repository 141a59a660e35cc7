"""The operator graph of a synthesized task: values (typed, shaped tensors) and the nodes that make them.

A graph is a DAG in single-assignment form. Graph inputs become the arguments of `forward` (and the
tensors of `get_inputs()`); every node applies one op to earlier values and defines one new value;
parameters live inside the nodes that own them (a `linear` node owns its `nn.Linear`). A value
carries its shape (a tuple of `dims` expressions), its dtype (`float32`, or `bool` for a comparison
mask) and a layout tag that says how ops read its axes:

    rows    (batch, features)             seq     (batch, sequence, features)
    signal  (batch, channels, length)     image   (batch, channels, height, width)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tasks.synth import dims
from tasks.synth.dims import Dim
from tasks.synth.sizes import ENVS, SizeTable, SizeVar

LAYOUTS = ("rows", "seq", "signal", "image")


@dataclass(frozen=True)
class Value:
    id: int
    shape: tuple  # of dims.Dim
    dtype: str  # "float32" or "bool"
    layout: str  # one of LAYOUTS


@dataclass(frozen=True)
class Node:
    op: str  # op name from the registry (tasks.synth.ops)
    inputs: tuple[int, ...]  # value ids, in argument order
    out: int  # the value this node defines
    attrs: tuple = ()  # (key, value) pairs: ints, floats, strings, bools, tuples of ints, or Dims

    def attr(self, key: str, default=None):
        for k, v in self.attrs:
            if k == key:
                return v
        return default


def is_dim(x) -> bool:
    return isinstance(x, (dims.Var, dims.One, dims.Window, dims.Upsampled, dims.Sum, dims.Prod))


def map_attr(attr, fn):
    """Apply `fn` to the Dims inside an attribute value (a Dim, or a tuple holding Dims)."""
    if is_dim(attr):
        return fn(attr)
    if isinstance(attr, tuple):
        return tuple(map_attr(a, fn) for a in attr)
    return attr


class _Bare(str):
    def __repr__(self) -> str:
        return str(self)


def render_attr(attr, dim_text) -> str:
    """An attribute value as text, its Dims rendered by `dim_text` (unquoted): `(channels, 1, 1)`."""
    return repr(map_attr(attr, lambda d: _Bare(dim_text(d))))


def attr_dims(attr) -> list:
    found: list = []
    map_attr(attr, found.append)
    return found


@dataclass
class Graph:
    sizes: SizeTable = field(default_factory=SizeTable)
    values: list[Value] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)  # graph-input value ids, in argument order
    nodes: list[Node] = field(default_factory=list)
    output: int | None = None

    def producer(self, value_id: int) -> Node | None:
        for node in self.nodes:
            if node.out == value_id:
                return node
        return None

    def ancestry(self, value_id: int) -> tuple[list[Node], list[int]]:
        """The nodes (in graph order) and graph inputs that `value_id` depends on."""
        need = {value_id}
        for node in reversed(self.nodes):
            if node.out in need:
                need.update(node.inputs)
        nodes = [n for n in self.nodes if n.out in need]
        return nodes, [i for i in self.inputs if i in need]

    def dims_valid(self, values: dict[int, int]) -> bool:
        return all(dims.evaluate(d, values) >= 1 for v in self.values for d in v.shape)

    def valid_everywhere(self) -> bool:
        return all(self.dims_valid(self.sizes.env(env)) for env in ENVS)


def prune(graph: Graph, output: int) -> Graph:
    """The part of `graph` that `output` depends on, with values renumbered (inputs first, then node
    outputs in order) and size constants renumbered by first use; unused constants are dropped."""
    nodes, inputs = graph.ancestry(output)
    value_map: dict[int, int] = {}
    for old in inputs + [n.out for n in nodes]:
        value_map[old] = len(value_map)

    var_map: dict[int, int] = {}

    def note(dim: Dim) -> None:
        for var in dims.variables(dim):
            if var not in var_map:
                var_map[var] = len(var_map)
                divides = graph.sizes.vars[var].divides
                if divides is not None:
                    note(divides)

    for vid in inputs:
        for d in graph.values[vid].shape:
            note(d)
    for node in nodes:
        for _, a in node.attrs:
            for d in attr_dims(a):
                note(d)
        for d in graph.values[node.out].shape:
            note(d)

    sizes = SizeTable()
    for old in sorted(var_map, key=var_map.get):
        v = graph.sizes.vars[old]
        divides = dims.substitute(v.divides, var_map) if v.divides is not None else None
        sizes.vars.append(SizeVar(v.role, dict(v.values), divides))

    def move(value: Value) -> Value:
        shape = tuple(dims.substitute(d, var_map) for d in value.shape)
        return replace(value, id=value_map[value.id], shape=shape)

    values = [move(graph.values[old]) for old in sorted(value_map, key=value_map.get)]
    new_nodes = [
        Node(
            n.op,
            tuple(value_map[i] for i in n.inputs),
            value_map[n.out],
            tuple((k, map_attr(a, lambda d: dims.substitute(d, var_map))) for k, a in n.attrs),
        )
        for n in nodes
    ]
    return Graph(sizes, values, [value_map[i] for i in inputs], new_nodes, value_map[output])
