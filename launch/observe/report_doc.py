"""The report as a list of blocks, rendered twice: to Markdown (report.md) and to one self-contained
HTML page (report.html, its images embedded), so both say the same.

Text inside blocks uses three Markdown inline forms and no others: `code`, **bold** and
[text](href); the HTML renderer escapes everything else.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: list[str]


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]
    align: list[str] = field(default_factory=list)  # "l" or "r" per column (default "l")


@dataclass(frozen=True)
class Image:
    title: str
    path: Path  # absolute, under the run directory
    href: str  # relative to the run directory


Block = Heading | Para | Bullets | Table | Image


def to_markdown(blocks: list[Block]) -> str:
    lines: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            lines += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Para):
            lines += [b.text, ""]
        elif isinstance(b, Bullets):
            lines += [f"* {item}" for item in b.items] + [""]
        elif isinstance(b, Table):
            align = [(b.align[i] if i < len(b.align) else "l") for i in range(len(b.header))]
            lines += [
                "| " + " | ".join(_cell(h) for h in b.header) + " |",
                "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
            ]
            lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in b.rows] + [""]
        elif isinstance(b, Image):
            lines += [f"![{b.title}]({b.href})", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """A table cell's text: a `|` would end the cell."""
    return text.replace("|", "\\|")


def to_html(blocks: list[Block], title: str) -> str:
    body: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            body.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            align = [(b.align[i] if i < len(b.align) else "l") for i in range(len(b.header))]
            cls = lambda i, align=align: ' class="r"' if align[i] == "r" else ""
            head = "".join(f"<th{cls(i)}>{_inline(h)}</th>" for i, h in enumerate(b.header))
            rows = "".join(
                "<tr>" + "".join(f"<td{cls(i)}>{_inline(c)}</td>" for i, c in enumerate(row)) + "</tr>"
                for row in b.rows
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(b, Image):
            data = base64.b64encode(b.path.read_bytes()).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(b.title)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(b.href)}</figcaption></figure>"
            )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


_STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;"
    "text-align:left;vertical-align:top}th{background:#f3f3f3}td.r,th.r{text-align:right}"
    "code{background:#f3f3f3;padding:0 3px}img{max-width:100%}figure{margin:1em 0}"
    "figcaption{color:#777;font-size:small}"
)

_INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")


def _inline(text: str) -> str:
    """Markdown's `code`, **bold** and [text](href) to HTML; everything else escaped."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos : m.start()]))
        code, bold, label, href = m.groups()
        if code is not None:
            out.append(f"<code>{html.escape(code)}</code>")
        elif bold is not None:
            out.append(f"<b>{_inline(bold)}</b>")
        else:
            out.append(f'<a href="{html.escape(href, quote=True)}">{_inline(label)}</a>')
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)
