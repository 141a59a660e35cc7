"""A small C++ source scanner: enough structure to split a load_inline extension, nothing more.

It masks comments, string/char literals and preprocessor lines (keeping every offset and newline),
then walks the top level of the file to find
* the declarations of the bound `functions` (to generate a binding TU from signatures alone),
* top-level `using` / `typedef` / namespace-alias statements the declarations may rely on,
* whether the source holds code beyond those declarations (else no kernel TU is needed),
and it reports static facts for other stages: which headers pull in the heavy torch API, which
vendor libraries are used natively, and which `at::`/`torch::` calls and Tensor methods appear.
Anything it cannot read with confidence makes `bound_declarations` return None, and the caller
builds the extension the way load_inline does (one TU), so a parse miss costs speed, never results.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

_RAW_STRING = re.compile(r'(?:u8|u|U|L)?R"([^()\\\s]{0,16})\(')
_CHAR_PREFIXES = ("L", "u", "U", "u8")


class Masked(NamedTuple):
    """Three views of one source, all with the same offsets (masked characters become spaces)."""

    nocomment: str  # comments removed
    code: str  # comments and preprocessor lines removed; literals kept
    masked: str  # comments, literals and preprocessor lines removed; each directive becomes ';'


def mask(text: str) -> Masked:
    """Mask a C++ source; newlines are always kept, so line numbers survive in every view.

    In `masked` each preprocessor directive becomes ';' so it separates top-level statements.
    """
    n = len(text)
    nocomment = list(text)
    masked = list(text)
    code = list(text)
    i = 0
    line_start = True
    while i < n:
        c = text[i]
        if c == "\n":
            line_start = True
            i += 1
            continue
        if line_start and c in " \t":
            i += 1
            continue
        if line_start and c == "#":
            j = i
            while j < n and text[j] != "\n":  # a directive runs to an unescaped newline
                if text[j] == "\\" and j + 1 < n and text[j + 1] == "\n":
                    j += 2
                    continue
                if text.startswith("//", j):  # a comment ends the directive's text
                    while j < n and text[j] != "\n":
                        nocomment[j] = " "
                        j += 1
                    break
                if text.startswith("/*", j):
                    k = text.find("*/", j + 2)
                    k = n if k < 0 else k + 2
                    for m in range(j, k):
                        if text[m] != "\n":
                            nocomment[m] = " "
                    j = k
                    continue
                j += 1
            for m in range(i, j):
                if text[m] != "\n":
                    masked[m] = code[m] = " "
            masked[i] = ";"
            i = j
            continue
        line_start = False
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                nocomment[i] = masked[i] = code[i] = " "
                i += 1
            continue
        if text.startswith("/*", i):
            k = text.find("*/", i + 2)
            k = n if k < 0 else k + 2
            for m in range(i, k):
                if text[m] != "\n":
                    nocomment[m] = masked[m] = code[m] = " "
            i = k
            continue
        raw = _RAW_STRING.match(text, i) if c in "uULR" else None
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find(")" + raw.group(1) + '"', raw.end())
            end = n if end < 0 else end + len(raw.group(1)) + 2
            for m in range(raw.end() - 1, end):
                if text[m] != "\n":
                    masked[m] = " "
            i = end
            continue
        if c == '"' or (c == "'" and _is_char_literal(text, i)):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            for m in range(i + 1, min(j, n)):
                masked[m] = " "
            i = j + 1
            continue
        i += 1
    return Masked("".join(nocomment), "".join(code), "".join(masked))


def _is_char_literal(text: str, i: int) -> bool:
    """A quote starts a char literal unless it is a C++14 digit separator (1'000)."""
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] == "_"):
        j -= 1
    word = text[j:i]
    return word == "" or word in _CHAR_PREFIXES


@dataclass(frozen=True)
class Declaration:
    name: str
    text: str  # "torch::Tensor relu_forward(torch::Tensor x);" with default arguments removed
    start: int  # offsets of the whole statement in the source (declaration or definition head)
    end: int


_BAD_PREFIX = re.compile(
    r"\b(template|static|inline|constexpr|consteval|extern|friend|virtual|"
    r"operator|auto|__attribute__|__declspec|__global__|__device__|__host__)\b"
)
_TYPE_CHARS = re.compile(r"^[\w\s:<>,*&\[\]]+$")
_WORD = re.compile(r"[A-Za-z_]\w*")


def _top_level_statements(masked: str):
    """Yield (start, end, kind) for depth-0 statements; kind is ';', '{' (a braced body) or 'eof'."""
    depth = 0
    parens = 0  # braces and semicolons inside (...) (default arguments, lambdas) are not structure
    start = 0
    i = 0
    n = len(masked)
    while i < n:
        c = masked[i]
        if c == "(":
            parens += 1
        elif c == ")":
            parens = max(parens - 1, 0)
        elif parens and depth == 0:
            pass
        elif c == "{":
            if depth == 0:
                body_start = i
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                return  # unbalanced: give up on structure
            if depth == 0:
                j = i + 1  # a braced body may be followed by ';' (struct, class, enum, lambda var)
                while j < n and masked[j] in " \t\r\n":
                    j += 1
                if j < n and masked[j] == ";" and _needs_semicolon(masked[start:body_start]):
                    i = j
                yield start, i + 1, "{"
                start = i + 1
        elif c == ";" and depth == 0:
            yield start, i + 1, ";"
            start = i + 1
        i += 1
    if depth == 0 and masked[start:].strip():
        yield start, n, "eof"


def _needs_semicolon(head: str) -> bool:
    return bool(re.search(r"\b(struct|class|union|enum)\b|=", head))


def _split_params(masked: str) -> list[tuple[int, int]]:
    """Spans of the parameters in a masked parameter list, split at top-level commas (angle
    brackets count until a default value starts; literals are masked, so their commas are gone)."""
    spans = []
    depth = angle = 0
    in_default = False
    begin = 0
    for i, c in enumerate(masked):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "<" and not in_default:
            angle += 1
        elif c == ">" and not in_default and angle > 0:
            angle -= 1
        elif c == "=" and depth == 0 and angle == 0:
            in_default = True
        elif c == "," and depth == 0 and angle == 0:
            spans.append((begin, i))
            begin, in_default = i + 1, False
    if masked[begin:].strip():
        spans.append((begin, len(masked)))
    return spans


def _without_default(masked: str, text: str) -> str:
    """The parameter's text up to its default value (found on the masked view)."""
    depth = angle = 0
    for i, c in enumerate(masked):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "<":
            angle += 1
        elif c == ">" and angle > 0:
            angle -= 1
        elif c == "=" and depth == 0 and angle == 0:
            return text[:i]
    return text


def _declaration_in(stmt_masked: str, stmt_text: str, offset: int, names: set[str]) -> Declaration | None:
    """The function declaration/definition head this statement starts with, if it names one of `names`."""
    m = None
    for w in _WORD.finditer(stmt_masked):
        if w.group(0) in names:
            rest = stmt_masked[w.end() :].lstrip()
            if rest.startswith("("):
                m = w
                break
    if m is None:
        return None
    prefix = stmt_masked[: m.start()]
    if not prefix.strip() or _BAD_PREFIX.search(prefix) or prefix.rstrip().endswith("::"):
        return None
    if not _TYPE_CHARS.match(prefix) or "(" in prefix:
        return None
    open_at = stmt_masked.index("(", m.end())
    depth = 0
    close_at = -1
    for j in range(open_at, len(stmt_masked)):
        if stmt_masked[j] == "(":
            depth += 1
        elif stmt_masked[j] == ")":
            depth -= 1
            if depth == 0:
                close_at = j
                break
    if close_at < 0:
        return None
    tail = stmt_masked[close_at + 1 :].strip()
    tail = re.sub(r"^noexcept\b", "", tail).strip()
    if not (tail.startswith("{") or tail == ";"):
        return None
    inner_m, inner_t = stmt_masked[open_at + 1 : close_at], stmt_text[open_at + 1 : close_at]
    params = [_without_default(inner_m[a:b], inner_t[a:b]).strip() for a, b in _split_params(inner_m)]
    ret = " ".join(stmt_text[: m.start()].split())
    text = f"{ret} {m.group(0)}({', '.join(' '.join(p.split()) for p in params)});"
    return Declaration(name=m.group(0), text=text, start=offset, end=offset + len(stmt_masked))


@dataclass(frozen=True)
class Bindable:
    """What a binding TU needs from the C++ sources, and whether a kernel TU is needed at all."""

    declarations: tuple[Declaration, ...]  # in `functions` order
    preamble: tuple[str, ...]  # top-level using/typedef/namespace-alias statements, in source order
    has_code: bool  # anything besides the declarations, preamble, and preprocessor lines


def bound_declarations(source: str, functions: tuple[str, ...]) -> Bindable | None:
    """Find a top-level declaration for every bound function; None when any is missing or unclear."""
    if not functions:
        return None
    views = mask(source)
    nocomment, masked = views.code, views.masked
    names = set(functions)
    found: dict[str, Declaration] = {}
    preamble = []
    has_code = False
    for start, end, kind in _top_level_statements(masked):
        stmt_m = masked[start:end]
        stmt_t = nocomment[start:end]
        body = stmt_m.strip().strip(";").strip()
        if not body:
            continue
        decl = _declaration_in(stmt_m, stmt_t, start, names)
        if decl is not None:
            if decl.name in found and found[decl.name].text != decl.text:
                return None  # overloads: leave it to the one-TU build (and its error message)
            found.setdefault(decl.name, decl)
            if kind == "{":
                has_code = True
            continue
        if kind == ";" and re.match(r"(using|typedef)\b|namespace\s+\w+\s*=", body):
            preamble.append(" ".join(stmt_t.split()))
            continue
        has_code = True
    if set(found) != names:
        return None
    return Bindable(tuple(found[f] for f in functions), tuple(preamble), has_code)


# -------------------------------------------------------------------------------- static facts
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)
_HEAVY_TORCH = re.compile(r"^(torch/|pybind11/)")
# The umbrella headers load_inline itself would include: the lean attempt stands in for them.
_UMBRELLA = re.compile(r"^torch/(extension|types|torch|all)\.h$")
_UMBRELLA_LINE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]torch/(extension|types|torch|all)\.h[>"].*$', re.MULTILINE)
_PYBIND_USE = re.compile(r"\bPYBIND11_|\bpybind11::|\bpy::")


def includes(source: str) -> list[str]:
    return _INCLUDE.findall(mask(source).nocomment)


def needs_full_torch(source: str) -> bool:
    """True when the source includes torch C++-frontend or pybind11 headers beyond the umbrella
    headers (torch/extension.h, ...), which the lean prelude may stand in for."""
    return any(_HEAVY_TORCH.match(h) and not _UMBRELLA.match(h) for h in includes(source))


def without_umbrella_includes(source: str) -> str:
    """The source with `#include <torch/extension.h>`-style lines commented out (line numbers kept),
    for a compile against the lean prelude; the full-prelude retry uses the source as written."""
    return _UMBRELLA_LINE.sub(lambda m: "// " + m.group(0).strip() + " (the lean prelude stands in)", source)


def uses_pybind(source: str) -> bool:
    """True when the source writes its own pybind11 code (its own module or py:: types)."""
    return bool(_PYBIND_USE.search(mask(source).masked))


_VENDOR_HEADERS = {
    "cublas": re.compile(r"^(cublas|cublasLt|cublas_v2|cublasXt)\b"),
    "cudnn": re.compile(r"^cudnn"),
    "cutlass": re.compile(r"^(cutlass|cute)/"),
    "cufft": re.compile(r"^cufft"),
    "curand": re.compile(r"^curand"),
    "cusparse": re.compile(r"^cusparse"),
    "cusolver": re.compile(r"^cusolver"),
    "mkl": re.compile(r"^mkl"),
    "openblas": re.compile(r"^(cblas|openblas)"),
    "onednn": re.compile(r"^(dnnl|oneapi/dnnl)"),
}
_VENDOR_LIBFLAGS = {
    "cublas": "cublas",
    "cublasLt": "cublas",
    "cudnn": "cudnn",
    "cufft": "cufft",
    "curand": "curand",
    "cusparse": "cusparse",
    "cusolver": "cusolver",
    "mkl_rt": "mkl",
    "openblas": "openblas",
    "cblas": "openblas",
    "dnnl": "onednn",
}
_VENDOR_SYMBOLS = {
    "cublas": "cublas",
    "cudnn": "cudnn",
    "cufft": "cufft",
    "curand": "curand",
    "cusparse": "cusparse",
    "cusolver": "cusolver",
    "cblas_": "openblas",
    "dnnl_": "onednn",
    "mkl_": "mkl",
}
_VENDOR_CALLS = {
    "getCurrentCUDABlasHandle": "cublas",
    "getCurrentCUDABlasLtHandle": "cublas",
    "getCudnnHandle": "cudnn",
    "getCurrentCUDASparseHandle": "cusparse",
}


def vendor_libs_in_sources(sources: list[str], ldflags: tuple[str, ...]) -> set[str]:
    """Vendor libraries named by includes, handle getters or -l flags."""
    found = set()
    for src in sources:
        for h in includes(src):
            for lib, pat in _VENDOR_HEADERS.items():
                if pat.match(h):
                    found.add(lib)
        code = mask(src).masked
        for call, lib in _VENDOR_CALLS.items():
            if call in code:
                found.add(lib)
    for flag in ldflags:
        for part in flag.split():
            if part.startswith("-l") and part[2:] in _VENDOR_LIBFLAGS:
                found.add(_VENDOR_LIBFLAGS[part[2:]])
    return found


def vendor_libs_in_symbols(undefined: list[str], defined: list[str]) -> set[str]:
    """Vendor libraries named by the built .so's undefined symbols (calls) or defined ones (CUTLASS
    is header-only, so its templates land in the .so as `cutlass::`/`cute::` symbols)."""
    found = set()
    for sym in undefined:
        for prefix, lib in _VENDOR_SYMBOLS.items():
            if sym.startswith(prefix):
                found.add(lib)
    if any("7cutlass" in s or "4cute" in s for s in defined):
        found.add("cutlass")
    return found


_QUALIFIED_CALL = re.compile(r"\b((?:torch|at|c10)(?:::\w+)+)\s*(?:<[^;{}()]*?>)?\s*\(")
_METHOD_CALL = re.compile(r"(?:\.|->)\s*(\w+)\s*(?:<[^;{}()]*?>)?\s*\(")


def torch_calls(sources: list[str], tensor_methods: frozenset[str]) -> tuple[list[str], list[str]]:
    """(qualified at::/torch::/c10:: function calls, Tensor-method names called), each sorted.

    Static hints for the legality stage; run-time interception is the authority.
    """
    calls, methods = set(), set()
    for src in sources:
        code = mask(src).masked
        calls.update(m.group(1) for m in _QUALIFIED_CALL.finditer(code))
        methods.update(m.group(1) for m in _METHOD_CALL.finditer(code) if m.group(1) in tensor_methods)
    return sorted(calls), sorted(methods)
