"""A graph as a KernelBench-format task file (tasks/README.md): a docstring describing the graph, the
size constants (module defaults = primary sizes), `KILN_CPU_SHAPES`, `KILN_ALT_SHAPES`, `Model` with its
parameters built as nn modules in `__init__` from `get_init_inputs()`, `get_inputs()` and
`get_init_inputs()`.

Everything emitted is a pure function of the graph, so a seed's files are byte-identical from run to
run. Names: size constants by role (`batch_size`, `dim`, `dim_2`, `channels`, `height`, ...), inputs
`x0, x1, ...`, node values `v1, v2, ...`, a node's parameters `self.<kind><k>` after its value vk.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.synth import dims
from tasks.synth.graph import Graph, attr_dims
from tasks.synth.levels import Level
from tasks.synth.ops import REGISTRY
from tasks.synth.sizes import ALT_ENVS, ROLES

LINE = 110  # wrap dict literals longer than this


@dataclass(frozen=True)
class TaskHeader:
    seed: int  # the --seed the task came from
    graph_hash: str  # canonical.canonical_hash of the graph
    level: Level


def size_names(graph: Graph) -> list[str]:
    """A module-constant name per size constant: the role's base name, then base_2, base_3, ..."""
    seen: dict[str, int] = {}
    names = []
    for var in graph.sizes.vars:
        base = ROLES[var.role].name
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


class Names:
    """The Python names of one graph's size constants, values and parameter modules."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.sizes = size_names(graph)
        self.values: dict[int, str] = {vid: f"x{i}" for i, vid in enumerate(graph.inputs)}
        self.modules: dict[int, str] = {}
        for k, node in enumerate(graph.nodes, start=1):
            self.values[node.out] = f"v{k}"
            self.modules[node.out] = f"{REGISTRY[node.op].module_prefix}{k}"

    def dim(self, d) -> str:
        return dims.render(d, lambda i: self.sizes[i])

    def shape(self, vid: int) -> str:
        v = self.graph.values[vid]
        return f"({', '.join(self.dim(d) for d in v.shape)}) {v.dtype}"


def _dict_literal(items: dict[str, int]) -> str:
    return "{" + ", ".join(f'"{k}": {v}' for k, v in items.items()) + "}"


def _assign_dict(name: str, items: dict[str, int]) -> list[str]:
    one_line = f"{name} = {_dict_literal(items)}"
    if len(one_line) <= LINE:
        return [one_line]
    lines, current = [f"{name} = {{"], "   "
    for k, v in items.items():
        entry = f' "{k}": {v},'
        if len(current) + len(entry) > LINE:
            lines.append(current)
            current = "   "
        current += entry
    return lines + [current, "}"]


def init_sizes(graph: Graph) -> list[int]:
    """Size constants the parameters are built from: `Model`'s constructor arguments, in order."""
    used: set[int] = set()
    for node in graph.nodes:
        if not REGISTRY[node.op].module_prefix:
            continue
        for _, a in node.attrs:
            for d in attr_dims(a):
                used.update(dims.variables(d))
    return sorted(used)


def docstring(graph: Graph, names: Names, header: TaskHeader) -> list[str]:
    ops = ", ".join(n.op for n in graph.nodes)
    lv = header.level
    lines = [
        f'"""Synthesized operator graph (kiln tasks synth, seed {header.seed}): {ops}.',
        f"Level {lv.level}: {lv.reason}. Canonical graph hash {header.graph_hash}.",
        "",
    ]
    for vid in graph.inputs:
        lines.append(f"    {names.values[vid]}: {names.shape(vid)}, an input")
    for node in graph.nodes:
        op = REGISTRY[node.op]
        text = op.describe(node, [names.values[i] for i in node.inputs], names.dim)
        lines.append(f"    {names.values[node.out]}: {names.shape(node.out)}")
        lines.append(f"        = {text}")
    lines.append(f"Returns {names.values[graph.output]}.")
    lines.append('"""')
    return lines


def model_class(graph: Graph, names: Names) -> list[str]:
    args = [names.sizes[i] for i in init_sizes(graph)]
    lines = [
        "class Model(nn.Module):",
        f"    def __init__(self{''.join(', ' + a for a in args)}):",
        "        super().__init__()",
    ]
    affine: list[str] = []
    for node in graph.nodes:
        op, module = REGISTRY[node.op], names.modules[node.out]
        lines += [f"        {line}" for line in op.init(node, module, names.dim)]
        affine += op.affine(node, module)
    if affine:
        lines += [
            "        # Normalisation parameters start away from their 1/0 defaults, so a kernel must apply them.",
            "        with torch.no_grad():",
            f"            for p in ({', '.join(affine)}{',' if len(affine) == 1 else ''}):",
            "                p.add_(0.1 * torch.randn_like(p))",
        ]
    inputs = ", ".join(names.values[i] for i in graph.inputs)
    lines += ["", f"    def forward(self, {inputs}):"]
    for node in graph.nodes:
        op = REGISTRY[node.op]
        expr = op.forward(node, [names.values[i] for i in node.inputs], names.modules[node.out], names.dim)
        lines.append(f"        {names.values[node.out]} = {expr}")
    lines.append(f"        return {names.values[graph.output]}")
    return lines


def emit(graph: Graph, header: TaskHeader) -> str:
    names = Names(graph)
    env = {e: {names.sizes[i]: v.values[e] for i, v in enumerate(graph.sizes.vars)} for e in ("primary", "cpu")}
    alts = [{names.sizes[i]: v.values[e] for i, v in enumerate(graph.sizes.vars)} for e in ALT_ENVS]
    lines = docstring(graph, names, header)
    lines += ["import torch", "import torch.nn as nn", "import torch.nn.functional as F", ""]
    lines += [f"{k} = {v}" for k, v in env["primary"].items()]
    lines += [""] + _assign_dict("KILN_CPU_SHAPES", env["cpu"])
    lines += ["KILN_ALT_SHAPES = ["] + [f"    {_dict_literal(a)}," for a in alts] + ["]", "", ""]
    lines += model_class(graph, names)
    shapes = [f"torch.randn({', '.join(names.dim(d) for d in graph.values[i].shape)})" for i in graph.inputs]
    lines += ["", "", "def get_inputs():", f"    return [{', '.join(shapes)}]"]
    init = ", ".join(names.sizes[i] for i in init_sizes(graph))
    lines += ["", "", "def get_init_inputs():", f"    return [{init}]", ""]
    return "\n".join(lines)
