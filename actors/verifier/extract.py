"""Stage 1, extract: turn raw model output (or a plain .py file) into candidate source.

A model answer usually wraps its code in a fenced block, sometimes several (a CUDA snippet, then the
module). The block that defines `ModelNew` wins; among several, the last (the model's final answer).
A fence left open by a truncated answer still yields its code. Text without any fence is taken as a
plain Python file. The result must parse and define `ModelNew` at module level.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass

from protocols.pyparse import parse_python

MAX_SOURCE_BYTES = 512 * 1024
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n]*$", re.MULTILINE)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}


@dataclass(frozen=True)
class Extracted:
    source: str  # the candidate module ("" when extraction failed)
    error: str  # why extraction failed; "" on success
    source_hash: str  # sha256 of `source` (of the raw text when extraction failed)

    @property
    def ok(self) -> bool:
        return not self.error


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, code) of every fenced block, in order; an unclosed last fence runs to the end."""
    blocks = []
    pos = 0
    while True:
        open_m = _FENCE.search(text, pos)
        if open_m is None:
            return blocks
        fence, tag = open_m.group(1), open_m.group(2).lower()
        body_start = open_m.end() + 1
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", re.MULTILINE)
        close_m = close.search(text, body_start)
        end = close_m.start() if close_m else len(text)
        blocks.append((tag, text[body_start:end]))
        if close_m is None:
            return blocks
        pos = close_m.end()


def choose_code(text: str) -> str:
    """The candidate code inside `text` (see the module docstring for the rule)."""
    blocks = fenced_blocks(text)
    if not blocks:
        return text
    with_model = [code for _, code in blocks if re.search(r"\bModelNew\b", code)]
    if with_model:
        return with_model[-1]
    python = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    return max(python or [code for _, code in blocks], key=len)


def defines_model_new(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "ModelNew":
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "ModelNew" for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name) == "ModelNew" for a in node.names
        ):
            return True
    return False


def extract(text: str) -> Extracted:
    """Stage 1. Never raises: a failure comes back as `Extracted.error`."""
    if not isinstance(text, str) or not text.strip():
        return Extracted("", "the answer is empty: no code to verify", source_hash(str(text or "")))
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES:
        return Extracted("", f"the answer is larger than {MAX_SOURCE_BYTES // 1024} KiB", source_hash(text))
    code = choose_code(text).strip("\n") + "\n"
    try:
        tree = parse_python(code)
    except SyntaxError as err:
        line = (err.text or "").strip()
        where = f"line {err.lineno}" + (f": `{line}`" if line else "")
        return Extracted("", f"the code does not parse ({err.msg}, {where})", source_hash(code))
    except ValueError as err:  # e.g. null bytes
        return Extracted("", f"the code does not parse ({err})", source_hash(code))
    if not defines_model_new(tree):
        hint = " (found a fenced block, but none defines it)" if fenced_blocks(text) else ""
        return Extracted(
            "",
            f"no `class ModelNew` at module level{hint}: the answer must define "
            "ModelNew with the same constructor and forward signature as Model",
            source_hash(code),
        )
    return Extracted(code, "", source_hash(code))
