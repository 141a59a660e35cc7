"""One PNG per mechanism: the full arm against the arm that switches it off, the metric curves over
learner steps (mean over seeds, the band min–max over seeds): reward, pass rate, the first-turn pass
rate and the repair success rate (each as the table defines it, over the run up to the step), and
the mechanism's counter (its running total)."""

from __future__ import annotations

from pathlib import Path

from launch.stages.ablate.arms import Arm, Counter
from launch.stages.ablate.summary import run_figures
from protocols import metric_keys as mk

Rows = list[dict]


# Rates over the run up to each step, by run_figures' definitions (summary.py), so a curve ends at the
# table's figure.
RATES = {"first-turn pass rate", "repair success rate"}


def curve(rows: Rows, key: str | None, counter: Counter | None = None) -> dict[int, float]:
    """step -> value: `key`'s value at each step that has it, a rate of RATES up to the step, or the
    counter's running count."""
    out: dict[int, float] = {}
    steps = sorted({int(r["step"]) for r in rows if "step" in r})
    for step in steps:
        upto = [r for r in rows if int(r.get("step", 0)) <= step]
        if counter is not None:
            out[step] = counter.count(upto)
        elif key in RATES:
            rate = run_figures(upto, None)[key]
            if rate is not None:
                out[step] = rate
        else:
            values = [r[key] for r in rows if int(r.get("step", -1)) == step and r.get(key) is not None]
            if values:
                out[step] = float(values[0])
    return out


def band(runs: list[Rows], key: str | None, counter: Counter | None = None):
    """(steps, mean, low, high) over the seeds' runs, at the steps every run that has any value reports."""
    curves = [curve(rows, key, counter) for rows in runs]
    steps = sorted(set().union(*curves)) if curves else []
    xs, mean, low, high = [], [], [], []
    for s in steps:
        vals = [c[s] for c in curves if s in c]
        xs.append(s)
        mean.append(sum(vals) / len(vals))
        low.append(min(vals))
        high.append(max(vals))
    return xs, mean, low, high


def plot_mechanism(full: list[Rows], ablated: list[Rows], arm: Arm, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward (mean PrimeEcho)", mk.REWARD_MEAN, None),
        ("pass rate", mk.REWARD_PASS_RATE, None),
        ("first-turn pass rate (run so far)", "first-turn pass rate", None),
        ("repair success rate (run so far)", "repair success rate", None),
        (f"{arm.counter.name} (running count)", None, arm.counter),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (title, key, counter) in zip(axes, panels, strict=True):
        for runs, label, color in ((full, "full", "tab:blue"), (ablated, arm.name, "tab:orange")):
            xs, mean, low, high = band(runs, key, counter)
            if xs:
                ax.plot(xs, mean, label=label, color=color)
                ax.fill_between(xs, low, high, color=color, alpha=0.25)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("learner step")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{arm.name}: {arm.switches_off}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
