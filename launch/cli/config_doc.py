"""Render the configuration reference (docs/configuration.md) from the schema's field help."""

from __future__ import annotations

import dataclasses
import types
import typing

from configs.loader import RENAMED
from configs.schema import KilnConfig


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # Optional[X] and X | None alike
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _bounds(meta) -> str:
    parts = []
    if meta.get("choices"):
        parts.append(
            " / ".join(f"`{c}`" for c in meta["choices"]) + (" / dotted path" if meta.get("dotted_ok") else "")
        )
    for key, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
        if meta.get(key) is not None:
            parts.append(f"{sym} {meta[key]}")
    return ", ".join(parts)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else f"`{f.default}`"
    return f"`{f.default_factory()}`"


def _rows(cls, prefix: str, out: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            nested.append((f, tp))
            continue
        out.append(
            f"| `{prefix}{f.name}` | {_type_name(tp)} | {_default(f)} | {_bounds(f.metadata)} | {f.metadata['help']} |"
        )
    for f, tp in nested:
        out += [
            "",
            f"### `{prefix}{f.name}` — {f.metadata['help']}",
            "",
            "| key | type | default | allowed | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        _rows(tp, f"{prefix}{f.name}.", out)


def render_markdown() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from `configs/schema.py` by `kiln config --markdown`; a test keeps it current.",
        "Load order: schema defaults, then a YAML preset (`--config`, default `configs/default.yaml`),",
        "then `section.key=value` overrides. Unknown keys and out-of-range values stop start-up.",
    ]
    for f in dataclasses.fields(KilnConfig):
        out += [
            "",
            f"## `{f.name}` — {f.metadata['help']}",
            "",
            "| key | type | default | allowed | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        _rows(typing.get_type_hints(KilnConfig)[f.name], f"{f.name}.", out)
    out += [
        "",
        "## Renamed keys",
        "",
        'A key of an earlier layout is refused with one line, "X was renamed to Y" (YAML and overrides alike).',
        "",
        "| old key | new key |",
        "| --- | --- |",
    ]
    out += [f"| `{old}` | `{new}` |" for old, new in RENAMED.items()]
    return "\n".join(out) + "\n"
