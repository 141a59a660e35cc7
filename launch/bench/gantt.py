"""The Gantt timeline of `kiln bench`: one panel per loop run, one row per actor, one colour per
activity over the run's measured window, so the idle gaps (waiting) show at a glance."""

from __future__ import annotations

from pathlib import Path

from launch.bench.train import LoopResult
from launch.observe.timeline import SpanRow, read_timeline, union

COLOURS = {"generating": "#1f77b4", "verifying": "#ff7f0e", "training": "#2ca02c", "syncing": "#9467bd"}
WAITING = "#e6e6e6"
ROLE_ORDER = ("learner", "rollout-", "verifier-")


def _row_order(actor: str) -> tuple[int, str]:
    return next((i for i, p in enumerate(ROLE_ORDER) if actor.startswith(p)), len(ROLE_ORDER)), actor


def plot_gantt(loops: list[LoopResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timelines = [read_timeline(Path(loop.run_dir)) for loop in loops]
    actors = [sorted({s.actor for s in spans}, key=_row_order) for spans in timelines]
    heights = [max(len(a), 1) * 0.55 + 0.9 for a in actors]
    fig, axes = plt.subplots(
        len(loops), 1, figsize=(13, sum(heights) + 1.2), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for ax, loop, spans, names in zip(axes[:, 0], loops, timelines, actors, strict=True):
        _panel(ax, loop, spans, names)
    handles = [Patch(color=c, label=a) for a, c in COLOURS.items()]
    handles.append(Patch(color=WAITING, label="waiting (no work recorded)"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, 0.985))
    fig.suptitle(title, y=0.998, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel(ax, loop: LoopResult, spans: list[SpanRow], actors: list[str]) -> None:
    t0, t1 = loop.window
    for row, actor in enumerate(actors):
        ax.broken_barh([(0, t1 - t0)], (row - 0.35, 0.7), color=WAITING)
        for activity, colour in COLOURS.items():
            pieces = union((s.start, s.end) for s in spans if s.actor == actor and s.activity == activity)
            bars = [(max(a, t0) - t0, min(b, t1) - max(a, t0)) for a, b in pieces if b > t0 and a < t1]
            if bars:
                ax.broken_barh(bars, (row - 0.35, 0.7), color=colour)
    labelled = -1.0
    for step, when in loop.step_times:
        ax.axvline(when - t0, color="black", linewidth=0.6, linestyle=":")
        if when - t0 - labelled >= 0.04 * (t1 - t0):  # labels of steps recorded close together would overlap
            ax.text(when - t0, -0.42, f"step {step}", fontsize=7, ha="center", va="bottom")
            labelled = when - t0
    ax.set_yticks(range(len(actors)), actors)
    ax.set_ylim(len(actors) - 0.45, -0.8)  # first actor on top, room above it for the step labels
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel("seconds since the measured window began (dotted: learner steps recorded)")
    busy = ", ".join(f"{a} {loop.busy.get(a, 0.0):.0%}" for a in actors)
    ax.set_title(
        f"η = {loop.eta}: {loop.samples_per_s:.3f} samples/s over {loop.window_s:.0f} s; busy {busy}",
        fontsize=10,
        loc="left",
    )
