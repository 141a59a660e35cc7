"""The report's plots (PNG, matplotlib's Agg backend: no display needed).

Every figure has a title, every axis its unit, per-step plots integer step ticks (a run of three
steps gets ticks 1, 2, 3, never 1.5), and verifier outcomes one fixed colour each
(launch/observe/outcomes.py), the same in every figure and every run. Each plot draws the series that exist
and names the keys that were not recorded, so a short or partial run still gets a report. A panel
with one step only, or only zeros, says so in words (launch/observe/words.py), and count axes
(groups, attempts) have whole-number ticks.

The actor timeline takes its spans from `timeline_spans`, the one place that knows where spans come
from (see its docstring).
"""

from __future__ import annotations

import itertools
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from launch.observe.outcomes import COLOURS, OUTCOMES, step_outcomes
from launch.observe.words import say_on, thin_data_note
from protocols import metric_keys as mk

Series = dict[str, list[tuple[int, float]]]  # key -> (step, value) in step order
Rows = list[dict]
Drawn = tuple[Path | None, list[str]]  # the PNG (None: nothing to draw) and the keys not recorded


def step_series(rows: Rows) -> Series:
    out: Series = defaultdict(list)
    for row in rows:
        if mk.PROGRESS_ELAPSED_S in row:
            continue
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                out[key].append((row["step"], float(value)))
    for points in out.values():
        points.sort(key=lambda p: p[0])
    return out


def progress_rows(rows: Rows) -> Rows:
    return [r for r in rows if isinstance(r.get(mk.PROGRESS_ELAPSED_S), (int, float))]


# ------------------------------------------------------------------------------------ helpers


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(panels: int, title: str, height: float = 2.6, width: float = 9.0, sharex: bool = True):
    plt = _plt()
    fig, axes = plt.subplots(panels, 1, figsize=(width, height * panels + 0.6), squeeze=False, sharex=sharex)
    fig.suptitle(title, fontsize=12)
    return plt, fig, axes[:, 0]


def learner_steps(series: Series) -> list[int]:
    """The steps the learner took (a per-step plot spans them all, also the last step of a run, in
    whose window no group finished and so no rollout figure was recorded)."""
    return [step for step, _ in series.get(mk.WEIGHTS_VERSION, [])]


def _integer_steps(ax, steps: list[int]) -> None:
    """Ticks on whole steps only: each step of a short run, a whole-number spacing on a long one."""
    from matplotlib.ticker import MaxNLocator

    if not steps:
        return
    lo, hi = int(min(steps)), int(max(steps))
    if hi - lo <= 15:
        ax.set_xticks(range(lo, hi + 1))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(lo - 0.6, hi + 0.6)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    lines: tuple[tuple[str, str], ...]  # (key, label)
    ylim: tuple[float, float] | None = None


def line_plot(series: Series, path: Path, title: str, panels: list[Panel]) -> Drawn:
    """One subplot per panel with data, each a set of lines against the learner step."""
    absent = [key for p in panels for key, _ in p.lines if not series.get(key)]
    panels = [p for p in panels if any(series.get(k) for k, _ in p.lines)]
    if not panels:
        return None, absent
    plt, fig, axes = _figure(len(panels), title)
    steps = learner_steps(series)
    for ax, panel in zip(axes, panels, strict=True):
        points = []
        for key, label in panel.lines:
            if series.get(key):
                xs, ys = zip(*series[key], strict=True)
                steps += xs
                points += series[key]
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        say_on(ax, thin_data_note(points))
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_ylabel(panel.ylabel)
        if panel.ylim:
            ax.set_ylim(*panel.ylim)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    _integer_steps(axes[-1], steps)
    axes[-1].set_xlabel("learner step")
    return _save(plt, fig, path), absent


def _outcome_bars(ax, xs: list[float], counts: list[dict[str, float]], width: float) -> None:
    """Stacked bars of attempts by outcome at each x, in the outcomes' fixed colours and order."""
    bottom = [0.0] * len(xs)
    for outcome in OUTCOMES:
        heights = [c.get(outcome, 0.0) for c in counts]
        if any(heights):
            ax.bar(xs, heights, width, bottom=bottom, color=COLOURS[outcome], label=outcome)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", title="outcome")


# -------------------------------------------------------------------------------------- plots


def plot_reward(series: Series, plots_dir: Path) -> Drawn:
    return line_plot(
        series,
        plots_dir / "reward.png",
        "Reward and pass rate per learner step",
        [
            Panel(
                "mean PrimeEcho reward of the episodes finished in the step's window",
                "reward R",
                ((mk.REWARD_MEAN, "reward mean"),),
            ),
            Panel(
                "episodes with a passing turn", "share of episodes", ((mk.REWARD_PASS_RATE, "pass rate"),), (0, 1.05)
            ),
        ],
    )


def plot_verifier(series: Series, plots_dir: Path) -> Drawn:
    """Stacked bars per step: the verified attempts of the step's window by outcome."""
    rows: dict[int, dict[str, float]] = defaultdict(dict)
    for key, points in series.items():
        if key == mk.VERIFIER_DONE or key.startswith(mk.VERIFIER_ERROR):
            for step, value in points:
                rows[step][key] = value
    counts = {step: step_outcomes(values) for step, values in rows.items()}
    counts = {step: c for step, c in counts.items() if c}
    if not counts:
        return None, [mk.VERIFIER_DONE, "verifier/error/<class>"]
    plt, fig, (ax,) = _figure(1, "Verifier outcomes per learner step", height=3.4)
    steps = sorted(counts)
    _outcome_bars(ax, steps, [counts[s] for s in steps], 0.8)
    ax.set_title(
        "verified attempts (every turn) of the episodes finished in the step's window", fontsize=10, loc="left"
    )
    ax.set_ylabel("attempts")
    ax.set_xlabel("learner step")
    _integer_steps(ax, steps + learner_steps(series))
    return _save(plt, fig, plots_dir / "verifier.png"), []


def plot_throughput(series: Series, plots_dir: Path) -> Drawn:
    return line_plot(
        series,
        plots_dir / "throughput.png",
        "Throughput per learner step",
        [
            Panel(
                "rollout samples (episodes) finished per second",
                "samples / s",
                ((mk.ROLLOUT_SAMPLES_PER_S, "rollout samples/s"),),
            ),
            Panel(
                "tokens per second",
                "tokens / s",
                ((mk.ROLLOUT_TOKENS_PER_S, "rollout response tokens/s"), (mk.TRAIN_TOKENS_PER_S, "learner tokens/s")),
            ),
        ],
    )


def plot_training(series: Series, plots_dir: Path) -> Drawn:
    return line_plot(
        series,
        plots_dir / "training.png",
        "Learner: loss and gradient norm per step",
        [
            Panel("policy loss (mean over the step's updates)", "loss", ((mk.TRAIN_LOSS, "loss"),)),
            Panel(
                "global gradient norm before clipping",
                "L2 norm",
                ((mk.TRAIN_GRAD_NORM, "mean over updates"), (mk.TRAIN_GRAD_NORM_MAX, "max over updates")),
            ),
        ],
    )


def plot_policy(series: Series, plots_dir: Path) -> Drawn:
    return line_plot(
        series,
        plots_dir / "policy.png",
        "Policy: entropy and response length per step",
        [
            Panel(
                "entropy of π_prox at the trained (sampled) positions", "nats / token", ((mk.TRAIN_ENTROPY, "entropy"),)
            ),
            Panel(
                "gradient-carrying response tokens per trained sequence",
                "tokens",
                ((mk.TRAIN_RESPONSE_LENGTH, "response length"),),
            ),
        ],
    )


def plot_corrections(series: Series, plots_dir: Path) -> Drawn:
    return line_plot(
        series,
        plots_dir / "corrections.png",
        "Off-policy corrections and filters per step",
        [
            Panel(
                "PPO clip (share of kept token-updates) and importance-weight truncation (share of kept tokens)",
                "share",
                (
                    (mk.TRAIN_CLIP_LOW_FRACTION, "clipped low (r < 1-ε_low, A < 0)"),
                    (mk.TRAIN_CLIP_HIGH_FRACTION, "clipped high (r > 1+ε_high, A > 0)"),
                    (mk.TRAIN_IS_TRUNCATED_FRACTION, "IS weight truncated at C"),
                ),
            ),
            Panel(
                "MirrorPop kept share of sequences; Buffered-Dynamic-Retry share of groups",
                "share",
                ((mk.TRAIN_KEPT_FRACTION, "MirrorPop kept"), (mk.REPLAY_BDR_SHARE, "BDR share")),
                (-0.05, 1.05),
            ),
        ],
    )


def plot_staleness(series: Series, plots_dir: Path) -> Drawn:
    """Histogram of trained samples by version lag, summed over the run."""
    lags = {
        int(k.rsplit("_", 1)[1]): sum(v for _, v in series[k]) for k in series if re.fullmatch(r"staleness/lag_\d+", k)
    }
    if not lags:
        return None, ["staleness/lag_<k>"]
    plt, fig, (ax,) = _figure(1, "Staleness of the trained samples", height=3.0, width=6.5)
    ax.bar(sorted(lags), [lags[k] for k in sorted(lags)], color="#1f77b4")
    ax.set_xticks(sorted(lags))
    ax.set_title("learner version minus the oldest version of a sample's gradient tokens", fontsize=9, loc="left")
    ax.set_xlabel("version lag (versions)")
    ax.set_ylabel("samples trained")
    return _save(plt, fig, plots_dir / "staleness.png"), []


def plot_progress(rows: Rows, plots_dir: Path) -> Drawn:
    """The rollout side against wall time (rows written with or without learner steps; a resumed run's
    sessions follow each other on one clock)."""
    rows = [r for r in progress_rows(rows) if isinstance(r.get("time"), (int, float))]
    if not rows:
        return None, ["progress/*"]
    t0 = min(r["time"] - r[mk.PROGRESS_ELAPSED_S] for r in rows)  # the first session's start
    minutes = [(r["time"] - t0) / 60 for r in rows]
    decoded = any(r.get(mk.PROGRESS_DECODED_TOKENS_PER_S) for r in rows)
    plt, fig, axes = _figure(
        4 if decoded else 3, "Rollout side over wall time (progress rows, with or without learner steps)"
    )
    ax = axes[0]
    for key, label in (
        (mk.PROGRESS_GROUPS, "groups completed"),
        (mk.PROGRESS_TRAINABLE, "trainable (trained or ready)"),
        (mk.PROGRESS_RETRY_BUFFER, "in the retry buffer now"),
    ):
        _time_line(ax, rows, minutes, key, label)
    for reason in sorted(
        {k.removeprefix(mk.PROGRESS_FILTERED) for r in rows for k in r if k.startswith(mk.PROGRESS_FILTERED)}
    ):
        _time_line(ax, rows, minutes, mk.progress_filtered(reason), f"filtered: {reason}", style="--")
    ax.set_title("run totals", fontsize=10, loc="left")
    ax.set_ylabel("groups")
    ax.legend(loc="upper left", fontsize="small")
    totals = [(m, r[mk.PROGRESS_GROUPS]) for m, r in zip(minutes, rows, strict=True) if mk.PROGRESS_GROUPS in r]
    say_on(ax, _progress_note(totals))
    counts = [
        {k.removeprefix(mk.PROGRESS_VERDICT): v for k, v in r.items() if k.startswith(mk.PROGRESS_VERDICT)}
        for r in rows
    ]
    gaps = [b - a for a, b in itertools.pairwise(minutes) if b > a] or [0.5]
    _outcome_bars(axes[1], minutes, counts, 0.8 * min(gaps))
    axes[1].set_title("verified attempts since the previous row, by outcome", fontsize=10, loc="left")
    axes[1].set_ylabel("attempts")
    if not any(any(c.values()) for c in counts):
        say_on(axes[1], "no attempt verified yet")
    for count_axis in axes[:2]:  # groups and attempts are counts: no tick at 0.5
        _integer_counts(count_axis)
    _time_line(axes[2], rows, minutes, mk.PROGRESS_PASS_RATE, "pass rate of the attempts since the previous row")
    axes[2].set_ylim(-0.05, 1.05)
    axes[2].set_ylabel("share")
    axes[2].legend(loc="upper left", fontsize="small")
    if decoded:  # forced answers are scored, not sampled: a forced-only run decodes nothing
        _time_line(axes[3], rows, minutes, mk.PROGRESS_DECODED_TOKENS_PER_S, "tokens the engines sampled")
        axes[3].set_ylabel("tokens / s")
        axes[3].set_ylim(bottom=0)
        axes[3].legend(loc="upper left", fontsize="small")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes since the run started")
    return _save(plt, fig, plots_dir / "progress.png"), []


def _progress_note(totals: list[tuple[float, float]]) -> str | None:
    if len(totals) == 1:
        return "one progress row only: no trend to draw yet"
    if totals and all(v == 0 for _, v in totals):
        return "no group completed yet"
    return None


def _integer_counts(ax) -> None:
    """Whole-number ticks; the axis spans at least 0..1, since over a narrower span (a run of zeros)
    the integer locator has only fractions to offer."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = ax.get_ylim()
    ax.set_ylim(min(lo, 0.0), max(hi, 1.0))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _time_line(ax, rows: Rows, minutes: list[float], key: str, label: str, style: str = "-") -> None:
    points = [(m, r[key]) for m, r in zip(minutes, rows, strict=True) if isinstance(r.get(key), (int, float))]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, style, marker="o" if len(xs) < 30 else None, markersize=3, label=label)


# ----------------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Span:
    """An actor at work from `start` to `end` (wall-clock seconds); `share` < 1 when only that share
    of the span is known to have been work, not when."""

    actor: str
    activity: str
    start: float
    end: float
    share: float = 1.0


def timeline_spans(run_dir: Path, rows: Rows) -> list[Span]:
    """Where the report's Gantt gets its spans.

    Exact spans when the run recorded them: RUN_DIR/timeline.jsonl, one JSON object per line with
    `actor`, `activity` (generating, verifying, training, syncing), `start` and `end` (wall-clock
    seconds), the span log of `kiln bench`'s recorder. Otherwise they come from metrics.jsonl: each
    learner step is a `training` span ending at its row (`train/step_s` long), the warm start a `warm
    start` span (`sft/seconds`), and every other actor's `busy/<actor>` share of a step's window a
    `busy` span over that window with that share (coarse: one bar per step window)."""
    recorded = _recorded_spans(Path(run_dir) / TIMELINE_FILE)
    if recorded:
        return recorded
    spans: list[Span] = []
    window_start: float | None = None  # a step row's busy shares cover the time since the previous step row
    for row in sorted(
        (r for r in rows if mk.PROGRESS_ELAPSED_S not in r and isinstance(r.get("time"), (int, float))),
        key=lambda r: r["time"],
    ):
        t = row["time"]
        if isinstance(row.get(mk.SFT_SECONDS), (int, float)):
            spans.append(Span("learner", "warm start", t - row[mk.SFT_SECONDS], t))
        if not isinstance(row.get(mk.TRAIN_STEP_S), (int, float)):
            continue
        spans.append(Span("learner", "training", t - row[mk.TRAIN_STEP_S], t))
        for key, share in row.items():
            if (
                key.startswith(mk.BUSY)
                and isinstance(share, (int, float))
                and key != mk.BUSY_LEARNER
                and window_start is not None
            ):
                spans.append(Span(key.removeprefix(mk.BUSY), "busy", window_start, t, max(0.0, min(1.0, share))))
        window_start = t
    return spans


TIMELINE_FILE = "timeline.jsonl"


def _recorded_spans(path: Path) -> list[Span]:
    """The spans of RUN_DIR/timeline.jsonl; lines that are not a span (a torn write) are skipped."""
    if not path.is_file():
        return []
    spans = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            d = json.loads(line)
            span = Span(str(d["actor"]), str(d["activity"]), float(d["start"]), float(d["end"]))
        except (ValueError, TypeError, KeyError):
            continue
        if span.end >= span.start:
            spans.append(span)
    return spans


ACTIVITY_COLOURS = {
    "warm start": "#98df8a",
    "training": "#2ca02c",
    "generating": "#1f77b4",
    "verifying": "#ff7f0e",
    "syncing": "#9467bd",
    "busy": "#4c72b0",
}
ROLE_ORDER = ("learner", "rollout-", "verifier-", "replay")


def plot_timeline(run_dir: Path, rows: Rows, plots_dir: Path) -> Drawn:
    """A Gantt chart: one row per actor, its spans over the run's wall time; the learner steps dotted."""
    spans = timeline_spans(run_dir, rows)
    if not spans:
        return None, ["busy/<actor>", mk.TRAIN_STEP_S]
    from matplotlib.patches import Patch

    t0 = min(s.start for s in spans)
    actors = sorted(
        {s.actor for s in spans},
        key=lambda a: (next((i for i, p in enumerate(ROLE_ORDER) if a.startswith(p)), len(ROLE_ORDER)), a),
    )
    plt, fig, (ax,) = _figure(1, "Actor timeline", height=0.5 * len(actors) + 1.6, width=11)
    width = max(s.end for s in spans) - t0
    for row, actor in enumerate(actors):
        for s in (s for s in spans if s.actor == actor):
            ax.broken_barh(
                [(s.start - t0, s.end - s.start)],
                (row - 0.35, 0.7),
                color=ACTIVITY_COLOURS.get(s.activity, "#7f7f7f"),
                alpha=0.15 + 0.85 * s.share,
                edgecolor="white" if s.share < 1 else None,
                linewidth=0.5,
            )
            if s.share < 1 and s.end - s.start > 0.04 * width:
                ax.text((s.start + s.end) / 2 - t0, row, f"{s.share:.0%}", ha="center", va="center", fontsize=7)
    for row in rows:
        if mk.TRAIN_LOSS in row and isinstance(row.get("time"), (int, float)):
            ax.axvline(row["time"] - t0, color="black", linewidth=0.6, linestyle=":")
    ax.set_yticks(range(len(actors)), actors)
    ax.set_ylim(len(actors) - 0.5, -0.5)
    ax.set_xlabel("seconds since the first recorded span (dotted: learner steps recorded)")
    shown = {s.activity for s in spans}
    if "busy" in shown:  # spans from metrics.jsonl
        ax.set_title(
            "warm start and training: the learner's steps; busy: the share of a step window an actor "
            "spent working (printed; opacity follows it)",
            fontsize=9,
            loc="left",
        )
    else:
        ax.set_title(
            "each actor's recorded spans of work (RUN_DIR/timeline.jsonl); blank: waiting", fontsize=9, loc="left"
        )
    ax.legend(
        handles=[Patch(color=c, label=a) for a, c in ACTIVITY_COLOURS.items() if a in shown],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )
    return _save(plt, fig, plots_dir / "timeline.png"), []


PLOTS = (  # (title, draw(series, rows, run_dir, plots_dir))
    ("Reward and pass rate", lambda s, r, d, p: plot_reward(s, p)),
    ("Verifier outcomes", lambda s, r, d, p: plot_verifier(s, p)),
    ("Rollout side over wall time", lambda s, r, d, p: plot_progress(r, p)),
    ("Throughput", lambda s, r, d, p: plot_throughput(s, p)),
    ("Actor timeline", lambda s, r, d, p: plot_timeline(d, r, p)),
    ("Staleness", lambda s, r, d, p: plot_staleness(s, p)),
    ("Learner: loss and gradient norm", lambda s, r, d, p: plot_training(s, p)),
    ("Policy: entropy and response length", lambda s, r, d, p: plot_policy(s, p)),
    ("Off-policy corrections and filters", lambda s, r, d, p: plot_corrections(s, p)),
)
