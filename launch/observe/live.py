"""The training run's live view: what a person watching `kiln train` needs at a glance.

On a terminal it is a `rich` panel redrawn in place: the step with the elapsed time and an estimate of
the time left, weight version, throughput, reward and pass rate, the verifier's outcomes (this step
and the run's total, one row per outcome in its fixed colour), staleness, the Buffered-Dynamic-Retry
share, MirrorPop's kept fraction, how busy each actor is, the rollout side's progress (which comes
with or without learner steps) and, while the run makes no progress, the warning that says why.
Without a terminal (CI logs, `nohup`), or when disabled, it prints one compact plain line per step
and per progress row instead, and the warning as its own line.

Values are merged: a key keeps its last value until a later row reports it again. A row that lacks a
rate (a step in whose window no group finished, at the end of a run) so leaves the last rate shown.
"""

from __future__ import annotations

import sys
import time
from typing import Self, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from launch.observe.outcomes import COLOURS, OUTCOMES, step_outcomes
from protocols import metric_keys as mk


class LiveView:
    """`with LiveView(enabled, total_steps) as view: view.update(step, values)`."""

    def __init__(
        self,
        enabled: bool,
        total_steps: int,
        *,
        console: Console | None = None,
        stream: TextIO | None = None,
        refresh_s: float = 0.5,
        started: float | None = None,
        clock=time.monotonic,
    ) -> None:
        """`started`: the run's start on `clock` (elapsed time counts from it; default: now)."""
        self.total_steps = total_steps
        self._stream = stream or sys.stdout
        self._console = console or Console(file=self._stream)
        self._rich = enabled and self._console.is_terminal
        self._refresh_s = refresh_s
        self._clock = clock
        self._started = clock() if started is None else started
        self._live: Live | None = None
        self._step = 0
        self._first: tuple[float, int] | None = None  # (time, step) of the first step this session saw
        self._last: tuple[float, int] | None = None
        self._values: dict[str, float] = {}
        self._totals: dict[str, float] = {}  # verifier outcomes over the run
        self._warning: str | None = None
        self._waiting: str | None = None  # what the run waits for before its first group

    def __enter__(self) -> Self:
        if self._rich:
            self._live = Live(
                self._render(), console=self._console, refresh_per_second=1 / self._refresh_s, transient=False
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def update(self, step: int, values: dict[str, float]) -> None:
        """A learner step's row."""
        now = self._clock()
        self._step = step
        self._first = self._first or (now, step)
        self._last = (now, step)
        for outcome, n in step_outcomes(values).items():
            self._totals[outcome] = self._totals.get(outcome, 0.0) + n
        self._merge(values, drop_prefix=mk.VERIFIER)
        self._show(self.plain_line())

    def progress(self, values: dict[str, float], warning: str | None, waiting: str | None = None) -> None:
        """A rollout-side progress row, the no-progress warning (None: there is none now), and what the
        run waits for before its first group completes (None once one did)."""
        self._merge(values, drop_prefix=mk.PROGRESS)  # a row's figures are its interval's: none carried over
        self._waiting = waiting
        fresh = warning is not None and warning != self._warning
        self._warning = warning
        self._show(self.progress_line())
        if fresh and self._live is None:
            print(f"WARNING {warning}", file=self._stream, flush=True)

    def _merge(self, values: dict[str, float], drop_prefix: str) -> None:
        """Merge a row; per-row counts under `drop_prefix` are replaced as a whole, not merged."""
        self._values = {k: v for k, v in self._values.items() if not k.startswith(drop_prefix)}
        self._values.update({k: v for k, v in values.items() if isinstance(v, (int, float))})

    def _show(self, line: str) -> None:
        if self._live is not None:
            self._live.update(self._render())
        else:
            print(line, file=self._stream, flush=True)

    # ------------------------------------------------------------------------------ content

    def timing(self) -> str:
        """'elapsed 0:02:15, ETA 0:05:12' (the ETA once two steps of this session give a rate)."""
        now = self._clock()
        text = f"elapsed {_clock(now - self._started)}"
        if self._first and self._last and self._last[1] > self._first[1]:
            per_step = (self._last[0] - self._first[0]) / (self._last[1] - self._first[1])
            left = max(self.total_steps - self._step, 0) * per_step - (now - self._last[0])
            text += f", ETA {_clock(max(left, 0.0))}"
        return text

    def plain_line(self) -> str:
        """One line per step for logs: `step 3/10 (elapsed 0:01:02) | weights v 3 | ... | verdicts passed 1, compile 2`."""
        v = self._values
        parts = [f"step {self._step}/{self.total_steps} ({self.timing()})"]
        parts += [f"{label} {_fmt(v[key])}" for key, label in _HEADLINE if key in v]
        outcomes = step_outcomes(v)
        if outcomes:
            parts.append("verdicts " + ", ".join(f"{o} {int(n)}" for o, n in outcomes.items()))
        busy = _busy(v)
        if busy:
            parts.append("busy " + " ".join(f"{a} {f:.0%}" for a, f in busy))
        return " | ".join(parts)

    def progress_line(self) -> str:
        """One line per progress row: `progress (elapsed 0:01:30) | groups 12 | episodes 48 | ...`."""
        v = self._values
        parts = [f"progress ({self.timing()})"]
        parts += [f"{label} {_fmt(v[key])}" for key, label in _PROGRESS if key in v]
        filtered = _prefixed(v, mk.PROGRESS_FILTERED)
        if filtered:
            parts.append("filtered " + ", ".join(f"{r} {int(n)}" for r, n in filtered))
        verdicts = _prefixed(v, mk.PROGRESS_VERDICT)
        if verdicts:
            parts.append("verdicts " + ", ".join(f"{o} {int(n)}" for o, n in _in_outcome_order(verdicts)))
        if self._waiting:
            parts.append(self._waiting)
        return " | ".join(parts)

    def _render(self) -> Panel:
        v = self._values
        head = Table.grid(padding=(0, 2))
        for _ in range(4):
            head.add_column()
        cells = [("step", f"{self._step}/{self.total_steps}")]
        cells += [(label, _fmt(v[key]) if key in v else "-") for key, label in _HEADLINE]
        for i in range(0, len(cells), 2):
            pair = cells[i : i + 2] + [("", "")] * (2 - len(cells[i : i + 2]))
            head.add_row(
                *(
                    Text(x, style="bold") if j % 2 == 0 else Text(x)
                    for j, x in enumerate((pair[0][0], pair[0][1], pair[1][0], pair[1][1]))
                )
            )
        parts = [Text(self.timing()), head]
        outcomes = step_outcomes(v)
        if outcomes or self._totals:
            table = Table(title="verifier outcomes", title_justify="left", show_edge=False)
            table.add_column("outcome")
            table.add_column("this step", justify="right")
            table.add_column("run", justify="right")
            for outcome in OUTCOMES:
                if outcome in outcomes or outcome in self._totals:
                    table.add_row(
                        Text(outcome, style=COLOURS[outcome]),
                        _fmt(outcomes.get(outcome, 0)),
                        _fmt(self._totals.get(outcome, 0)),
                    )
            parts.append(table)
        progress = [(label, _fmt(v[key])) for key, label in _PROGRESS if key in v]
        progress += [(f"filtered {r}", _fmt(n)) for r, n in _prefixed(v, mk.PROGRESS_FILTERED)]
        if progress:
            table = Table(title="rollout side", title_justify="left", show_edge=False)
            table.add_column("quantity")
            table.add_column("value", justify="right")
            for label, value in progress:
                table.add_row(label, value)
            parts.append(table)
        busy = _busy(v)
        if busy:
            table = Table(title="actor busy", title_justify="left", show_edge=False)
            table.add_column("actor")
            table.add_column("busy", justify="right")
            for actor, fraction in busy:
                table.add_row(actor, f"{fraction:.0%}")
            parts.append(table)
        if self._waiting:
            parts.append(Text(self._waiting, style="italic"))
        if self._warning:
            parts.append(Text(self._warning, style="bold yellow"))
        return Panel(Group(*parts), title="kiln train")


_HEADLINE = (
    (mk.WEIGHTS_VERSION, "weights v"),
    (mk.ROLLOUT_SAMPLES_PER_S, "samples/s"),
    (mk.ROLLOUT_TOKENS_PER_S, "tokens/s"),
    (mk.TRAIN_LOSS, "loss"),
    (mk.REWARD_MEAN, "reward"),
    (mk.REWARD_PASS_RATE, "pass rate"),
    (mk.STALENESS_MEAN, "staleness mean"),
    (mk.STALENESS_MAX, "staleness max"),
    (mk.REPLAY_BDR_SHARE, "BDR share"),
    (mk.TRAIN_KEPT_FRACTION, "MirrorPop kept"),
)

_PROGRESS = (
    (mk.PROGRESS_GROUPS, "groups"),
    (mk.PROGRESS_EPISODES, "episodes"),
    (mk.PROGRESS_TRAINABLE, "trainable groups"),
    (mk.PROGRESS_PASS_RATE, "pass rate"),
    (mk.PROGRESS_DECODED_TOKENS_PER_S, "decoded tok/s"),
    (mk.PROGRESS_RETRY_BUFFER, "retry buffer"),
)


def _prefixed(values: dict[str, float], prefix: str) -> list[tuple[str, float]]:
    return sorted((k.removeprefix(prefix), n) for k, n in values.items() if k.startswith(prefix))


def _in_outcome_order(items: list[tuple[str, float]]) -> list[tuple[str, float]]:
    order = {o: i for i, o in enumerate(OUTCOMES)}
    return sorted(items, key=lambda item: order.get(item[0], len(order)))


def _busy(values: dict[str, float]) -> list[tuple[str, float]]:
    return sorted((k.removeprefix(mk.BUSY), f) for k, f in values.items() if k.startswith(mk.BUSY))


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _fmt(x: float) -> str:
    if float(x).is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
