"""Decontamination: drop generated tasks that match a task of an `--exclude` directory (a KernelBench
clone, a validation split, Kiln's own tasks/).

An excluded file need not come from this generator, so it is matched two ways, each computed the same
way for excluded files and generated ones:

* **Op structure.** `Model` is built on the meta device (no memory, no compute) and traced with
  torch.fx; the traced DAG is hashed with each call reduced to a canonical op name (`F.relu`,
  `torch.relu`, `x.relu()` and `nn.ReLU` are all `relu`; `mm`/`bmm`/`@` are `matmul`), operands of
  commutative ops sorted, data-movement calls (view, reshape, transpose, contiguous, ...) passed
  through, and shapes, sizes, constants and attributes ignored. A generated `conv2d -> relu -> bias
  add` therefore matches a hand-written `Conv2d + ReLU + BiasAdd` with other kernel sizes. It does not
  match a different formulation of the same maths (RMSNorm written out as pow/mean/rsqrt is not
  `nn.RMSNorm`).
* **Normalised source.** For files fx cannot trace (data-dependent Python control flow): the hash of
  the syntax tree with docstrings, `KILN_*` assignments and the values of module-level numeric
  constants removed. It catches copies of a file with other sizes, comments or formatting, and
  nothing more.

Building an excluded `Model` runs that file's module code and constructor (on the meta device), as
`replay.tasks` would run it: point `--exclude` only at task files you trust.
"""

from __future__ import annotations

import ast
import hashlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx

from protocols.pyparse import parse_python
from tasks.loader import TaskLoadError, discover
from tasks.synth.checks import LoadError, load_source

# Calls that move or view data without computing: the signature looks through them.
PLUMBING = frozenset(
    {
        "view",
        "reshape",
        "flatten",
        "unflatten",
        "transpose",
        "permute",
        "contiguous",
        "squeeze",
        "unsqueeze",
        "expand",
        "expandas",
        "t",
        "to",
        "float",
        "type",
        "typeas",
        "clone",
        "detach",
        "getitem",
        "narrow",
        "split",
        "chunk",
        "identity",
        "dropout",
        "viewas",
        "flattenlayer",
        "movedim",
    }
)
# Calls that yield sizes, not tensors.
SIZE_QUERIES = frozenset({"size", "dim", "numel", "getattr", "shape"})
ALIASES = {
    "iadd": "add",
    "radd": "add",
    "isub": "sub",
    "rsub": "sub",
    "imul": "mul",
    "rmul": "mul",
    "truediv": "div",
    "itruediv": "div",
    "divide": "div",
    "multiply": "mul",
    "subtract": "sub",
    "mm": "matmul",
    "bmm": "matmul",
    "max": "amax",
    "min": "amin",
    "clip": "clamp",
    "vectornorm": "norm",
    "swish": "silu",
    "absolute": "abs",
}
COMMUTATIVE = frozenset({"add", "mul", "maximum", "minimum"})


class ExcludeError(ValueError):
    """An --exclude path does not exist or holds no task file."""


def op_key(raw: str) -> str:
    key = raw.lower().strip("_").replace("_", "")
    return ALIASES.get(key, key)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def structure_signature(model: torch.nn.Module) -> str:
    """The op-structure hash of a module's forward (raises when fx cannot trace it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = torch.fx.symbolic_trace(model)
    modules = dict(gm.named_modules())
    signature: dict[torch.fx.Node, str | None] = {}  # None: a size, not a tensor
    result = ""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            signature[node] = "input"
            continue
        if node.op == "get_attr":
            signature[node] = "param"
            continue
        operands = _node_args(node)
        tensors = [signature[a] for a in operands if signature[a] is not None]
        if node.op == "output":
            result = _digest("out(" + ",".join(tensors) + ")")
            continue
        if node.op == "call_module":
            key = op_key(type(modules[node.target]).__name__)
        elif node.op == "call_function":
            key = op_key(getattr(node.target, "__name__", str(node.target)))
        else:
            key = op_key(str(node.target))
        if key in SIZE_QUERIES or (operands and not tensors):
            signature[node] = None
        elif key in PLUMBING:
            signature[node] = tensors[0] if tensors else None
        else:
            signature[node] = _digest(f"{key}({','.join(sorted(tensors) if key in COMMUTATIVE else tensors)})")
    return result


def _node_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a))
    return found


def source_signature(source: str, filename: str) -> str:
    """Load a task file and hash the op structure of its Model (raises LoadError or a trace error)."""
    module = load_source(source, filename)
    with torch.device("meta"):
        model = module.Model(*module.get_init_inputs())
    return structure_signature(model)


def normalised_source_hash(source: str) -> str | None:
    """Hash of the syntax tree without docstrings, KILN_* assignments and module-level number values."""
    try:
        tree = parse_python(source)
    except SyntaxError:
        return None
    body = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.startswith("KILN_") for t in stmt.targets
        ):
            continue
        if (
            isinstance(stmt, ast.Assign)
            and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, (int, float))
        ):
            stmt = ast.Assign(targets=stmt.targets, value=ast.Constant(0))
        body.append(stmt)
    tree.body = body
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:] or [ast.Pass()]
    return _digest(ast.dump(tree, annotate_fields=False))


@dataclass
class ExcludeIndex:
    """What the --exclude directories hold, by op structure and by normalised source."""

    structures: dict[str, str] = field(default_factory=dict)  # signature -> first file with it
    sources: dict[str, str] = field(default_factory=dict)  # normalised-source hash -> first file
    files: int = 0
    untraced: dict[str, str] = field(default_factory=dict)  # file -> why it was matched by source only

    def match(self, source: str, filename: str) -> tuple[str, str] | None:
        """(how, excluded file) when a generated task matches, else None."""
        try:
            sig = source_signature(source, filename)
        except Exception:  # noqa: BLE001 - a generated file always traces; if not, the source hash still applies
            sig = None
        if sig is not None and sig in self.structures:
            return "structure", self.structures[sig]
        norm = normalised_source_hash(source)
        if norm is not None and norm in self.sources:
            return "source", self.sources[norm]
        return None


def build_index(paths: list[Path], *, trace: bool = True) -> ExcludeIndex:
    """The index of every task under `paths` (directories or files); ExcludeError for a path without one.
    `trace=False` indexes normalised sources only and runs no task code."""
    index = ExcludeIndex()
    for root in paths:
        try:
            found = discover(root)
        except TaskLoadError as err:
            raise ExcludeError(f"--exclude {root}: {err}") from None
        index_files(index, [tf.path for tf in found], trace=trace)
    return index


def index_files(index: ExcludeIndex, files: list[Path], *, trace: bool = True) -> ExcludeIndex:
    """Add task files to `index` (by normalised source, and by op structure when `trace`)."""
    for path in files:
        index.files += 1
        text = path.read_text(encoding="utf-8", errors="replace")
        norm = normalised_source_hash(text)
        if norm is not None:
            index.sources.setdefault(norm, str(path))
        if not trace:
            continue
        try:
            index.structures.setdefault(source_signature(text, str(path)), str(path))
        except LoadError as err:
            index.untraced[str(path)] = f"does not load: {err}"
        except Exception as err:  # noqa: BLE001 - an untraceable file is recorded, not fatal
            index.untraced[str(path)] = f"not traceable: {type(err).__name__}: {str(err)[:120]}"
    return index
