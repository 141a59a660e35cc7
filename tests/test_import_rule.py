"""The import rule of the actor packages: a module under `actors/<role>/` (rollout, learner, verifier,
buffer) imports only `protocols`, `configs`, `tasks`, `actors.base`, the algorithm's decisions
`actors.decisions`, the shared package `actors.policy`, its own role package, and third-party or
standard-library modules. The shared package (and `actors/` itself) imports no role package. So the
roles never know each other: what two roles share lives in `actors.policy`, `actors.decisions` or,
torch-free, in `protocols`.

The check walks every module's syntax tree: top-level and function-local `import` / `from ... import`
(relative ones resolved against the module's package), and the string arguments of
`importlib.import_module(...)` and `__import__(...)`.

`launch/`'s rule: its import graph (the imports that run; those under `if TYPE_CHECKING:` never do) has
no cycle, and only the `kiln` command itself (`launch/cli/`) imports `launch.cli`: subcommands take
their shared config arguments from `launch.config_args`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("rollout", "learner", "verifier", "buffer")
SHARED = ("protocols", "configs", "tasks", "actors.base", "actors.decisions", "actors.policy")
# Kiln's own top-level packages; any other top-level name is third-party or the standard library.
FIRST_PARTY = frozenset(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def allowed(importer: str, target: str) -> bool:
    """May module `importer` (under actors/) import module `target`?"""
    if target.split(".")[0] not in FIRST_PARTY or target == "actors":  # the root package holds no role's code
        return True
    role = importer.split(".")[1] if importer.count(".") >= 1 else ""
    own = (f"actors.{role}",) if role in ROLES else ()
    return any(within(target, p) for p in SHARED + own)


def resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute name of `from <level dots><module> import ...` written in `importer`."""
    if level == 0:
        return module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports(
    source: str, importer: str, is_package: bool = False, runtime_only: bool = False
) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, names taken from it) for every import in `source`, wherever it is written;
    with `runtime_only`, not those under `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(source)
    if runtime_only:
        tree = _WithoutTypeChecking().visit(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(importer, is_package, node.module, node.level)
            found.append((node.lineno, target, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                package = node.args[1] if len(node.args) > 1 else None
                text = arg.value
                if text.startswith(".") and isinstance(package, ast.Constant) and isinstance(package.value, str):
                    dots = len(text) - len(text.lstrip("."))
                    text = resolve(package.value, True, text[dots:] or None, dots)
                found.append((node.lineno, text, ()))
    return found


class _WithoutTypeChecking(ast.NodeTransformer):
    def visit_If(self, node: ast.If):
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
        if name == "TYPE_CHECKING":
            node.body = [ast.Pass()]
        return self.generic_visit(node)


def violations(source: str, importer: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import that breaks the rule; `from actors import rollout` imports the
    module actors.rollout, so the names of an allowed `from` import are checked as modules too."""
    bad = []
    for line, target, names in imports(source, importer, is_package):
        if not allowed(importer, target):
            bad.append((line, target))
            continue
        bad += [(line, f"{target}.{n}") for n in names if n != "*" and not allowed(importer, f"{target}.{n}")]
    return bad


def test_actor_packages_import_no_other_actor_package():
    bad = []
    for path in sorted((ROOT / "actors").rglob("*.py")):
        importer = module_name(path)
        for line, target in violations(path.read_text(), importer, path.name == "__init__.py"):
            bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not bad, "actor packages import each other (move shared code to actors/policy or protocols):\n" + "\n".join(
        bad
    )


def test_the_check_sees_every_form_of_a_cross_import():
    source = """
import actors.rollout.engine
from actors.buffer.sender import EpisodeSender
from actors import base, verifier
from .. import rollout
from ..rollout import engine

def late():
    from actors.rollout.model import build_model
    import importlib
    importlib.import_module("actors.verifier.interface")
    __import__("actors.buffer")
    importlib.import_module(".engine", "actors.rollout")
"""
    assert violations(source, "actors.learner.something") == [
        (2, "actors.rollout.engine"),
        (3, "actors.buffer.sender"),
        (4, "actors.verifier"),
        (5, "actors.rollout"),
        (6, "actors.rollout"),
        (9, "actors.rollout.model"),
        (11, "actors.verifier.interface"),
        (12, "actors.buffer"),
        (13, "actors.rollout.engine"),
    ]


def test_the_check_lets_through_what_the_rule_allows():
    source = """
import torch
import actors
import protocols
from protocols.channels import RequestClient
from configs import ModelConfig
from tasks.loader import load_tasks
from actors.base import Actor
from actors import base, policy
from actors.policy.model import build_model
from actors.learner.losses import loss
from .losses import loss
from . import batch
import importlib
importlib.import_module("actors.learner.backend")
"""
    assert violations(source, "actors.learner.something") == []
    # the shared package imports no role package, not even through a relative import
    assert violations("from ..rollout import engine\nfrom . import sampling\n", "actors.policy.model") == [
        (1, "actors.rollout")
    ]
    assert violations("from ...buffer import sender\n", "actors.policy.weights", is_package=True) == [
        (1, "actors.buffer")
    ]
    assert violations("import launch.driver.plan\n", "actors.buffer.actor") == [(1, "launch.driver.plan")]


# ------------------------------------------------------------------------------------------ launch/


def launch_graph() -> dict[str, set[str]]:
    """Module -> the launch modules it imports when it runs (a `from pkg import name` that names a module
    is an arrow to that module)."""
    paths = {module_name(p): p for p in sorted((ROOT / "launch").rglob("*.py"))}
    graph = {}
    for importer, path in paths.items():
        arrows = set()
        for _, target, names in imports(path.read_text(), importer, path.name == "__init__.py", runtime_only=True):
            if not within(target, "launch"):
                continue
            named = {f"{target}.{n}" for n in names if f"{target}.{n}" in paths}
            arrows |= named or {target}
        graph[importer] = arrows - {importer}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as [a, b, ..., a], or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_launch_import_graph_has_no_cycle():
    cycle = find_cycle(launch_graph())
    assert not cycle, "launch/ imports in a circle: " + " -> ".join(cycle)


# The rooms whose modules implement subcommands or serve them; none of them may import the CLI.
SUBCOMMAND_ROOMS = ("launch.stages", "launch.bench", "launch.driver", "launch.observe")


def arrows_into_cli(graph: dict[str, set[str]]) -> list[str]:
    """'importer imports target' for every arrow into launch.cli from a module outside it."""
    return [
        f"{importer} imports {target}"
        for importer, targets in sorted(graph.items())
        if not within(importer, "launch.cli")
        for target in sorted(targets)
        if within(target, "launch.cli")
    ]


def test_nothing_outside_the_cli_imports_the_cli():
    graph = launch_graph()
    for room in SUBCOMMAND_ROOMS:  # the check covers every room (a renamed room would escape it)
        assert any(within(module, room) for module in graph), f"{room} has no module in launch/'s graph"
    bad = arrows_into_cli(graph)
    assert not bad, (
        "only launch/cli/ imports launch.cli (take config arguments from launch.config_args):\n" + "\n".join(bad)
    )


def test_the_cli_check_sees_a_subcommand_that_imports_the_cli():
    graph = {
        "launch.cli.main": {"launch.stages.eval.cli", "launch.config_args"},
        "launch.stages.eval.cli": {"launch.config_args"},
        "launch.bench.eval_solutions": {"launch.cli.main"},
        "launch.driver.train": {"launch.cli"},
        "launch.observe.report": {"launch.observe.metrics"},
    }
    assert arrows_into_cli(graph) == [
        "launch.bench.eval_solutions imports launch.cli.main",
        "launch.driver.train imports launch.cli",
    ]


def test_the_launch_checks_see_a_cycle_and_skip_type_only_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    source = """
from typing import TYPE_CHECKING
import launch.driver.plan
if TYPE_CHECKING:
    from launch.driver.supervisor import ActorSpec
def late():
    from launch.cli.main import main
"""
    assert [t for _, t, _ in imports(source, "launch.x", runtime_only=True)] == [
        "typing",
        "launch.driver.plan",
        "launch.cli.main",
    ]
