"""`parse_python(source)`: `ast.parse`, one call at a time in this process.

CPython 3.11.7 has a race (gh-106905): `ast.parse` keeps its recursion-depth bookkeeping in state
that every thread shares, so when the garbage collector runs a Python finalizer mid-parse and that
finalizer (or a thread switch it allows) parses too, the parse fails with `SystemError: AST
constructor recursion depth mismatch`. The verifier's request threads parse candidates at once
(extract.py, legality.py's static scan), so a random honest candidate came back `infra`. Actors that
share a process (an in-process run) parse beside them: the rollout's prompts read each reference's
constants (actors/policy/prompts.py), and a bare parse there made a verifier's parse fail in a CI
run of the demo (session 36). So every parse of Kiln's goes through this one lock, in this shared
package; a candidate parses in milliseconds, so it costs nothing measurable. Standard library only:
the verifier's legality.py, which the sandbox imports, uses it.
"""

from __future__ import annotations

import ast
import threading

_PARSE_LOCK = threading.RLock()  # reentrant: a finalizer that parses mid-parse must not deadlock


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse(source, filename)` under the process-wide parse lock (raises as ast.parse does)."""
    with _PARSE_LOCK:
        return ast.parse(source, filename)
