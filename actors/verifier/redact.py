"""What leaves the verifier about a candidate, bounded and without host details.

Every VerifyResult the kernel verifier makes passes its feedback through `feedback` and its
diagnostics through `diagnostics` (verifier.py, `_result`), so whatever reached them (compiler
output, a sandbox's exception text, the tail of a crashed sandbox's output, a note) is bounded and
redacted on the way out, into the verdict, the verdict cache and the next turn's prompt:

* bounded: the feedback at MAX_FEEDBACK characters; in the diagnostics every string at MAX_STRING,
  every list at MAX_ITEMS entries, every mapping at MAX_ITEMS keys, nesting at MAX_DEPTH, and the
  whole at MAX_DIAGNOSTICS bytes of JSON (the largest entries give way first);
* redacted: every host detail the verifier knows of becomes a neutral name: the host's name
  (`<host>`), Kiln's tree (`<kiln>`), its cache and scratch directories (`<cache>`, `<tmp>`), the
  home directory (`~`), torch's package (`<torch>`) and the Python installation (`<python>`).

This is the last line, not the first: a sandbox sees no host name (its own UTS namespace), its scratch
and libraries at neutral paths, and no other candidate's build (jail.py), so what it could quote it
cannot see. Text the candidate encodes (reversed, hashed) is not recognised here; what it can see is
what bounds that.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import sys
import tempfile
from pathlib import Path

MAX_FEEDBACK = 4000
MAX_STRING = 2000
MAX_ITEMS = 200
MAX_DEPTH = 8
MAX_DIAGNOSTICS = 256 << 10
_CUT = " ... (cut)"


def feedback(text: str, extra_roots: dict[str, str] | None = None) -> str:
    """Feedback as it leaves: host details redacted, at most MAX_FEEDBACK characters."""
    return _cut(redact(str(text)[: 4 * MAX_FEEDBACK], extra_roots), MAX_FEEDBACK)


def diagnostics(value, extra_roots: dict[str, str] | None = None) -> dict:
    """Diagnostics as they leave: JSON values (NaN and infinities as strings, tuples as lists, unknown
    objects as their repr), bounded and redacted (the module docstring)."""
    out = _bounded(value, 0, extra_roots)
    if not isinstance(out, dict):
        out = {"value": out}
    size = _size(out)
    while size > MAX_DIAGNOSTICS and out:
        key = max(out, key=lambda k: _size(out[k]))
        dropped = _size(out[key])
        out[key] = f"(left out: {dropped} bytes)"
        size = _size(out)
    return out


def redact(text: str, extra_roots: dict[str, str] | None = None) -> str:
    """`text` with every known host detail replaced by its neutral name (longest first)."""
    roots = dict(host_roots())
    roots.update(extra_roots or {})
    for path in sorted(roots, key=len, reverse=True):
        if path and path in text:
            text = text.replace(path, roots[path])
    return text


@functools.lru_cache(maxsize=1)
def host_roots() -> tuple[tuple[str, str], ...]:
    """(host detail, neutral name) for every detail of this host the verifier knows of: its name and
    the directories that would say who runs it, where, or what else it verified."""
    roots: dict[str, str] = {}

    def add(path, name: str) -> None:
        if not path:
            return
        for p in {str(path), os.path.realpath(str(path))}:
            p = p.rstrip("/")
            if len(p) > 1:
                roots.setdefault(p, name)

    try:
        import torch

        add(Path(torch.__file__).resolve().parent, "<torch>")
    except ImportError:  # pragma: no cover - the verifier always has torch
        pass
    add(Path(__file__).resolve().parents[2], "<kiln>")
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        add(prefix, "<python>")
    if os.environ.get("KILN_CACHE_DIR"):
        add(os.environ["KILN_CACHE_DIR"], "<cache>")
    add(Path.home() / ".cache", "<cache>")
    add(os.path.expanduser("~"), "~")
    add(tempfile.gettempdir(), "<tmp>")
    name = socket.gethostname()
    if len(name) >= 4 and name not in ("localhost", "sandbox"):  # a short or generic name would mangle text
        roots.setdefault(name, "<host>")
    return tuple(roots.items())


def _bounded(value, depth: int, extra_roots):
    if isinstance(value, str):
        return _cut(redact(value[: 4 * MAX_STRING], extra_roots), MAX_STRING)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth >= MAX_DEPTH:
        return _cut(redact(repr(value)[: 4 * MAX_STRING], extra_roots), MAX_STRING)
    if isinstance(value, dict):
        items = list(value.items())
        out = {_cut(str(k), 100): _bounded(v, depth + 1, extra_roots) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["..."] = f"{len(items) - MAX_ITEMS} more entries left out"
        return out
    if isinstance(value, (list, tuple)):
        out = [_bounded(v, depth + 1, extra_roots) for v in list(value[:MAX_ITEMS])]
        if len(value) > MAX_ITEMS:
            out.append(f"... {len(value) - MAX_ITEMS} more left out")
        return out
    return _cut(redact(repr(value)[: 4 * MAX_STRING], extra_roots), MAX_STRING)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - len(_CUT)] + _CUT


def _size(value) -> int:
    return len(json.dumps(value))
