"""Turn compiler and linker output into feedback a model can act on, and nothing more.

The first few errors, each with the code line the compiler quoted, with build paths replaced by
the names the candidate knows (`cpp_source:12:5`, `cuda_source(40)`, `<torch>/ATen/...`), and at
most a screenful. Whether a failure is the machine's is never read from this text (the candidate
writes it); the build service decides that from evidence of its own (service.py).

`sanitize` is the last step before feedback: a line that still names a host path (after the
known roots became `<torch>`, `<python>`, `<cuda>`, `<system>`) is about a file outside the
candidate's sources, and the compiler may quote that file's text in it or right after it
(`#include "/etc/passwd"` makes g++ print its first line): the line and its quoted snippet go.
"""

from __future__ import annotations

import re

MAX_ERRORS = 3
MAX_LINES = 24
MAX_CHARS = 2400

# g++ "file:line:col: error:", EDG/nvcc "file(line): error:", ld "undefined reference", fatal errors.
_ERROR = re.compile(
    r"(:\d+:\d+: (fatal )?error:|\(\d+\): (catastrophic )?error:|: fatal error:|"
    r"undefined reference to|undefined symbol|multiple definition of|^\S*ld: .*error)"
)
_SNIPPET = re.compile(r"^\s*(\d+\s*\||\|)|^\s{2,}\S.*$|^\s*\^")
_CONTEXT = re.compile(
    r"(required from here|In function|In instantiation of|In member function|In file included from|"
    r"from [^ ]+:\d+)"
)
# An error that more torch headers could fix: the lean prelude lacked a name or an overload.
_MISSING_NAME = re.compile(
    r"was not declared|is not a member of|has not been declared|does not name a|"
    r"incomplete type|has no member|no member named|is undefined|not a namespace|"
    r"no matching function|no matching member|is not a template|"
    r"no instance of (overloaded|function)|not a class, namespace"
)


# Public headers and tools, named without their host path (kept in feedback).
SYSTEM_ROOTS = {
    "/usr/include/": "<system>/",
    "/usr/local/include/": "<system>/",
    "/usr/lib/gcc/": "<system>/",
    "/usr/lib/llvm": "<system>/llvm",
    "/usr/bin/": "",
    "/usr/local/bin/": "",
}
_HOST_PATH = re.compile(r"(?<![\w<>.+@-])/(?:[\w.+@-]+/)*[\w.+@-]+")
_REMOVED = "(a line about a file outside your sources was removed)"


def sanitize(text: str) -> str:
    """Drop every line that still names a host path, with the snippet lines the compiler printed after it."""
    out: list[str] = []
    skipping = False
    for line in scrub(text, SYSTEM_ROOTS).splitlines():
        if skipping and _SNIPPET.match(line) and not _ERROR.search(line):
            continue
        skipping = False
        if _HOST_PATH.search(line):
            if not out or out[-1] != _REMOVED:
                out.append(_REMOVED)
            skipping = True
            continue
        out.append(line)
    return "\n".join(out)


def scrub(text: str, replacements: dict[str, str]) -> str:
    """Replace build paths (longest first) with stable, user-facing names."""
    for path in sorted(replacements, key=len, reverse=True):
        if path:
            text = text.replace(path, replacements[path])
    return text


def first_errors(output: str, replacements: dict[str, str], user_files: tuple[str, ...] = ()) -> str:
    """The first MAX_ERRORS errors with their quoted code lines; the whole (trimmed) output if none
    is recognised. When an error sits in a header, the nearest preceding line that points into the
    candidate's own files ("required from here") is kept before it."""
    lines = scrub(scrub(output, replacements), SYSTEM_ROOTS).splitlines()
    picked: list[str] = []
    errors = 0
    i = 0
    last_user_context = None
    while i < len(lines) and errors < MAX_ERRORS:
        line = lines[i]
        if _CONTEXT.search(line) and any(f in line for f in user_files):
            last_user_context = line.strip()
        if _ERROR.search(line):
            in_user = any(line.startswith(f) for f in user_files)
            if not in_user and last_user_context and last_user_context not in picked:
                picked.append(last_user_context)
            picked.append(line.rstrip())
            errors += 1
            j = i + 1
            while j < len(lines) and j - i <= 3 and _SNIPPET.match(lines[j]) and not _ERROR.search(lines[j]):
                picked.append(lines[j].rstrip())
                j += 1
            i = j
            continue
        i += 1
    if not picked:
        picked = [ln.rstrip() for ln in lines if ln.strip()][-MAX_LINES:]
    text = "\n".join(picked[:MAX_LINES])
    return text[:MAX_CHARS]


def looks_like_missing_api(errors: str) -> bool:
    """True when the first error is a missing name/overload (the full torch headers may supply it)."""
    for line in errors.splitlines():
        if _ERROR.search(line):
            return bool(_MISSING_NAME.search(line))
    return False
