"""Normalised source of a kernel candidate, for `kiln rft`'s deduplication: two answers that differ only
in names, comments, docstrings and layout get one key; answers that differ in what they compute or how
get different keys.

* Python: the syntax tree (comments, docstrings and layout gone) with every name the file binds
  (functions, classes, arguments, variables, `self.<attribute>` it assigns, `import ... as` aliases,
  the extension's `name=`) renamed to `p0`, `p1`, ... in order of first appearance. Names the file
  does not bind (torch, nn.Module, load_inline, ...) and the contract names (`Model`, `ModelNew`,
  `forward`, `get_inputs`, ...) stay: they are what the code calls, not what it chose to call things.
* Embedded C++/CUDA (a string constant that looks like C++ source): tokenised with comments and
  whitespace dropped, and its local identifiers (those it declares: variables, parameters, functions,
  kernels) renamed `c0`, `c1`, ... (a counter of its own, so a Python name that happens to equal a C++
  one moves nothing); a Python reference to a C++ function (`functions=[...]`, `ext.fn(...)`) takes
  the C++ rename. Library names (`torch::empty_like`, `expf`, `threadIdx`),
  member names after `.`, `->` and `::`, and preprocessor lines stay as written.

Declarations are found by shape, without a C++ parser: an identifier after a type-like token (an
identifier that is not a statement keyword, or `*`, `&`, `>` after one) and before `( = ; , [ ) {`.
It errs towards renaming: an expression like `a * b;` renames `b`, which can only merge two answers
that differ in such a name, never split two copies.
"""

from __future__ import annotations

import ast
import hashlib
import re

from protocols.pyparse import parse_python

CONTRACT = frozenset(
    {"Model", "ModelNew", "forward", "__init__", "get_inputs", "get_init_inputs", "self", "cls", "super"}
)
CPP_HINT = re.compile(r"[{};]")
_TOKEN = re.compile(
    r"""
    (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<pre>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<number>\.?\d[\w.]*(?:[eE][+-]\d+)?\w*)
  | (?P<id>[A-Za-z_]\w*)
  | (?P<op><<<|>>>|::|->|\+\+|--|&&|\|\||<<=|>>=|[-+*/%&|^!=<>]=|[^\s])
    """,
    re.DOTALL | re.VERBOSE,
)
NOT_TYPES = frozenset(
    {
        "return",
        "else",
        "case",
        "goto",
        "new",
        "delete",
        "throw",
        "sizeof",
        "if",
        "while",
        "for",
        "switch",
        "do",
        "co_return",
        "co_yield",
        "default",
        "public",
        "private",
        "protected",
    }
)
KEYWORDS = NOT_TYPES | frozenset(
    {
        "int",
        "float",
        "double",
        "char",
        "bool",
        "void",
        "long",
        "short",
        "unsigned",
        "signed",
        "auto",
        "const",
        "constexpr",
        "static",
        "inline",
        "struct",
        "class",
        "template",
        "typename",
        "namespace",
        "using",
        "true",
        "false",
        "nullptr",
        "break",
        "continue",
        "volatile",
        "extern",
        "register",
        "__global__",
        "__device__",
        "__host__",
        "__shared__",
        "__restrict__",
        "__forceinline__",
        "__syncthreads",
        "size_t",
        "int64_t",
        "int32_t",
        "uint32_t",
        "uint64_t",
        "half",
        "float2",
        "float4",
        "threadIdx",
        "blockIdx",
        "blockDim",
        "gridDim",
        "warpSize",
        "this",
        "operator",
        "typedef",
        "enum",
        "union",
        "std",
        "torch",
        "at",
        "c10",
    }
)
DECLARATION_END = frozenset({"(", "=", ";", ",", "[", ")", "{"})
MEMBER = frozenset({".", "->", "::"})


class Canon:
    """Names renamed to `<prefix>0`, `<prefix>1`, ... in order of first use."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.names: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self.names:
            self.names[name] = f"{self.prefix}{len(self.names)}"
        return self.names[name]


def cpp_tokens(source: str) -> list[tuple[str, str]]:
    """(kind, text) of every token, comments dropped, preprocessor lines with their spaces collapsed."""
    out = []
    for m in _TOKEN.finditer(source):
        kind = m.lastgroup
        if kind == "comment":
            continue
        text = " ".join(m.group().split()) if kind == "pre" else m.group()
        out.append((kind, text))
    return out


def cpp_declared(tokens: list[tuple[str, str]]) -> set[str]:
    """The identifiers a C++ source declares (module docstring)."""
    declared = set()
    for j in range(1, len(tokens) - 1):
        kind, name = tokens[j]
        if kind != "id" or name in KEYWORDS or tokens[j + 1][1] not in DECLARATION_END:
            continue
        if j >= 1 and tokens[j - 1][1] in MEMBER:
            continue
        prev_kind, prev = tokens[j - 1]
        if (prev_kind == "id" and prev not in NOT_TYPES) or (
            prev in ("*", "&", ">")
            and j >= 2
            and (tokens[j - 2][0] == "id" or tokens[j - 2][1] in ("*", ">"))
            and tokens[j + 1][1] != "("
        ):
            declared.add(name)
    return declared


def cpp_normal(tokens: list[tuple[str, str]], declared: set[str], canon: Canon) -> str:
    parts = []
    for j, (kind, text) in enumerate(tokens):
        if kind == "id" and text in declared and not (j and tokens[j - 1][1] in MEMBER):
            text = canon(text)
        parts.append(text)
    return " ".join(parts)


def looks_like_cpp(text: str) -> bool:
    return len(text) >= 40 and bool(CPP_HINT.search(text)) and "\n" in text


class _Renamer(ast.NodeTransformer):
    """Renames bound Python names through `canon`; C++ strings become their normal form (`cpp`), and a
    Python attribute or string naming a C++ declaration takes that declaration's C++ name."""

    def __init__(self, bound: set[str], attrs: set[str], cpp: dict[str, str], cpp_canon: Canon, canon: Canon) -> None:
        self.bound, self.attrs, self.cpp, self.cpp_canon, self.canon = bound, attrs, cpp, cpp_canon, canon

    def _name(self, name: str) -> str:
        return self.canon(name) if name in self.bound and name not in CONTRACT else name

    def visit_Name(self, node: ast.Name):
        node.id = self._name(node.id)
        return node

    def visit_arg(self, node: ast.arg):
        node.arg = self._name(node.arg)
        node.annotation = None
        return node

    def visit_FunctionDef(self, node):
        node.name = self._name(node.name)
        _drop_docstring(node)
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef):
        node.name = self._name(node.name)
        _drop_docstring(node)
        return self.generic_visit(node)

    def visit_alias(self, node: ast.alias):
        if node.asname:
            node.asname = self._name(node.asname)
        return node

    def visit_Attribute(self, node: ast.Attribute):
        self.generic_visit(node)
        if node.attr in self.cpp_canon.names:
            node.attr = self.cpp_canon.names[node.attr]
        elif node.attr in self.attrs:
            node.attr = self.canon(node.attr)
        return node

    def visit_keyword(self, node: ast.keyword):
        self.generic_visit(node)
        if node.arg == "name" and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            node.value = ast.Constant("extension")  # load_inline's module name: a label, not code
        elif node.arg is not None and node.arg in self.bound:
            node.arg = self._name(node.arg)
        return node

    def visit_Constant(self, node: ast.Constant):
        value = node.value
        if isinstance(value, str):
            if value in self.cpp:
                return ast.Constant(self.cpp[value])
            if value in self.cpp_canon.names:
                return ast.Constant(self.cpp_canon.names[value])
            if value in self.bound:
                return ast.Constant(self.canon(value))
        return node


def _drop_docstring(node) -> None:
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node.body = body[1:] or [ast.Pass()]


def _bound_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names the module binds, attributes it assigns on self)."""
    bound, attrs = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.alias) and node.asname:
            bound.add(node.asname)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            attrs.add(node.attr)
    return bound - CONTRACT, attrs


def normalised_source(source: str) -> str:
    """The normal form of a candidate file (module docstring); a file that does not parse is its text
    with whitespace collapsed."""
    try:
        tree = parse_python(source)
    except (SyntaxError, ValueError):
        return " ".join(source.split())
    _drop_docstring(tree)
    cpp_canon, cpp = Canon("c"), {}  # every C++ string first, so Python references find their names
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and looks_like_cpp(node.value)
            and node.value not in cpp
        ):
            tokens = cpp_tokens(node.value)
            cpp[node.value] = cpp_normal(tokens, cpp_declared(tokens), cpp_canon)
    bound, attrs = _bound_names(tree)
    tree = _Renamer(bound, attrs, cpp, cpp_canon, Canon("p")).visit(tree)
    return ast.dump(tree, annotate_fields=False)


def source_key(source: str) -> str:
    """A short hash of the normal form: equal for copies that differ only in names, comments and layout."""
    return hashlib.sha256(normalised_source(source).encode()).hexdigest()[:16]
