"""The training run's live view: what a person watching `kiln train` needs at a glance.

On a terminal it is a `rich` panel redrawn in place: progress, weight version, throughput, reward
and pass rate, the verifier's outcome breakdown, staleness, the Buffered-Dynamic-Retry share,
MirrorPop's kept fraction and how busy each actor is. Without a terminal (CI logs, `nohup`), or
when disabled, it prints one compact plain line per step instead.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

# Verifier outcomes in pipeline order, then the overall pass count.
STAGES = ("extract", "compile", "run", "correctness", "legality", "performance", "done", "passed")


class LiveView:
    """`with LiveView(enabled, total_steps) as view: view.update(step, values)`. Values are merged:
    a key keeps its last value until a later step reports it again."""

    def __init__(self, enabled: bool, total_steps: int, *, console: Console | None = None,
                 stream: TextIO | None = None, refresh_s: float = 0.5) -> None:
        self.total_steps = total_steps
        self._stream = stream or sys.stdout
        self._console = console or Console(file=self._stream)
        self._rich = enabled and self._console.is_terminal
        self._refresh_s = refresh_s
        self._live: Live | None = None
        self._step = 0
        self._values: dict[str, float] = {}

    def __enter__(self) -> "LiveView":
        if self._rich:
            self._live = Live(self._render(), console=self._console, refresh_per_second=1 / self._refresh_s,
                              transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def update(self, step: int, values: dict[str, float]) -> None:
        self._step = step
        self._values.update({k: v for k, v in values.items() if isinstance(v, (int, float))})
        if self._live is not None:
            self._live.update(self._render())
        else:
            print(self.plain_line(), file=self._stream, flush=True)

    # ------------------------------------------------------------------------------ content

    def plain_line(self) -> str:
        """One line per step for logs: `step 3/10 v3 | 1.2 samples/s ... | verifier compile 2 done 1`."""
        v = self._values
        parts = [f"step {self._step}/{self.total_steps}"]
        parts += [f"{label} {_fmt(v[key])}" for key, label in _HEADLINE if key in v]
        stages = _stage_counts(v)
        if stages:
            parts.append("verifier " + " ".join(f"{s} {int(n)}" for s, n in stages))
        busy = _busy(v)
        if busy:
            parts.append("busy " + " ".join(f"{a} {f:.0%}" for a, f in busy))
        return " | ".join(parts)

    def _render(self) -> Panel:
        v = self._values
        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        head.add_row("step", f"{self._step}/{self.total_steps}")
        for key, label in _HEADLINE:
            head.add_row(label, _fmt(v[key]) if key in v else "-")
        parts = [head]
        stages = _stage_counts(v)
        if stages:
            table = Table(title="verifier outcomes this step", title_justify="left", show_edge=False)
            for stage, _ in stages:
                table.add_column(stage, justify="right")
            table.add_row(*(str(int(n)) for _, n in stages))
            parts.append(table)
        busy = _busy(v)
        if busy:
            table = Table(title="actor busy", title_justify="left", show_edge=False)
            table.add_column("actor")
            table.add_column("busy", justify="right")
            for actor, fraction in busy:
                table.add_row(actor, f"{fraction:.0%}")
            parts.append(table)
        return Panel(Group(*parts), title="kiln train")


_HEADLINE = (
    ("weights/version", "weights v"),
    ("rollout/samples_per_s", "samples/s"),
    ("rollout/tokens_per_s", "tokens/s"),
    ("train/loss", "loss"),
    ("reward/mean", "reward"),
    ("reward/pass_rate", "pass rate"),
    ("staleness/mean", "staleness mean"),
    ("staleness/max", "staleness max"),
    ("replay/bdr_share", "BDR share"),
    ("train/kept_fraction", "MirrorPop kept"),
)


def _stage_counts(values: dict[str, float]) -> list[tuple[str, float]]:
    known = [(s, values[f"verifier/{s}"]) for s in STAGES if f"verifier/{s}" in values]
    errors = sorted((k.removeprefix("verifier/"), n) for k, n in values.items() if k.startswith("verifier/error/"))
    return known + errors


def _busy(values: dict[str, float]) -> list[tuple[str, float]]:
    return sorted((k.removeprefix("busy/"), f) for k, f in values.items() if k.startswith("busy/"))


def _fmt(x: float) -> str:
    if float(x).is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
