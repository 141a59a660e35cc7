"""The evaluation's outputs shaped like a model card: the markdown table (rows are models or answer
sets, columns the metrics per level and Overall), the JSON summary's metric rows, the bar chart and
the side-by-side comparison of two summaries (`kiln eval --compare A.json B.json`).

Numbers are percentages with one decimal; "n/a" where a number cannot be given (no usable attempt,
no task with k usable attempts, a baseline that was not timed).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from launch.observe.words import plural, say_on
from launch.stages.eval.metrics import BASELINES, Summary

# What must match for two evaluations to be compared number for number.
SETTINGS_KEYS = ("verifier", "device", "toolchain", "fast_threshold")


def columns(summary_json: dict) -> list[tuple[str, str, str | int]]:
    """(header, metric, key) per column: every metric for each level, then Overall."""
    names = [f"Pass@{k}" for k in summary_json["ks"]] + [f"Avg@{summary_json['n']}"]
    names += [f"Faster-{b}" for b in BASELINES]
    labels = [r["label"] for r in summary_json["rows"]]
    return [(f"{name} {_short(label)}", name, label) for name in names for label in labels]


def _short(label: str) -> str:
    return label.replace("level ", "L")


def row_values(summary_json: dict) -> dict[tuple[str, str], float | None]:
    """(metric name, row label) -> value in [0, 1] or None."""
    out = {}
    for r in summary_json["rows"]:
        for k in summary_json["ks"]:
            out[(f"Pass@{k}", r["label"])] = r["pass_at"].get(str(k))
        out[(f"Avg@{summary_json['n']}", r["label"])] = r["avg"]
        for b in BASELINES:
            out[(f"Faster-{b}", r["label"])] = r["faster"].get(b)
    return out


def summary_rows(summary: Summary) -> list[dict]:
    """The JSON form of the metric rows (k keys as strings, as JSON has them)."""
    rows = []
    for r in summary.rows:
        row = asdict(r)
        row["pass_at"] = {str(k): v for k, v in r.pass_at.items()}
        row["short_of_k"] = {str(k): v for k, v in r.short_of_k.items()}
        rows.append(row)
    return rows


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def markdown_table(entries: list[tuple[str, dict]], *, deltas: bool = False) -> str:
    """One row per (name, summary JSON); with `deltas`, a last row of the second minus the first in
    percentage points. The columns are the first entry's."""
    first = entries[0][1]
    cols = columns(first)
    lines = ["| model | " + " | ".join(h for h, _, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    values = [row_values(s) for _, s in entries]
    for (name, _), vals in zip(entries, values, strict=True):
        lines.append(f"| {name} | " + " | ".join(_pct(vals.get((m, lb))) for _, m, lb in cols) + " |")
    if deltas and len(entries) == 2:
        a, b = values
        cells = []
        for _, m, lb in cols:
            x, y = a.get((m, lb)), b.get((m, lb))
            cells.append("n/a" if x is None or y is None else f"{100 * (y - x):+.1f}")
        lines.append(f"| Δ ({entries[1][0]} − {entries[0][0]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", caption(first)])


def caption(s: dict) -> str:
    o = s["rows"][-1]
    short = ", ".join(f"k={k}: {v}" for k, v in o["short_of_k"].items() if v)
    return (
        f"Percent. Pass@k: unbiased estimator per task, averaged over tasks. Avg@{s['n']} (mean correctness "
        f"over the n = {s['n']} samples per task) and Faster-eager / Faster-compile (passed and speedup "
        f"> {s['fast_threshold']:g}x over eager PyTorch / torch.compile) are per attempt. Overall pools every "
        f"attempt of every level. {plural(o['attempts'], 'attempt')} on {plural(o['tasks'], 'task')}; "
        f"{plural(o['infra'], 'infra verdict')} excluded"
        + (f"; tasks with fewer than k usable attempts, left out of Pass@k: {short}" if short else "")
        + f"; {plural(len(s.get('failed_loads', [])), 'task file')} failed to load."
    )


def setting_differences(a: dict, b: dict) -> list[str]:
    """One line per setting that differs between two summaries (verifier, device, toolchain, threshold)."""
    out = []
    for key in SETTINGS_KEYS:
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            for sub in sorted(set(x) | set(y)):
                if x.get(sub) != y.get(sub):
                    out.append(f"{key}.{sub}: {x.get(sub)!r} vs {y.get(sub)!r}")
        elif x != y:
            out.append(f"{key}: {x!r} vs {y!r}")
    return out


def bar_chart(summary_json: dict, name: str, path: Path) -> None:
    """Grouped bars: one group per level and Overall, one bar per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in summary_json["rows"]]
    metrics = list(dict.fromkeys(m for _, m, _ in columns(summary_json)))
    values = row_values(summary_json)
    width = 0.8 / len(metrics)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(labels)), 4.0))
    heights = []
    for i, m in enumerate(metrics):
        ys = [100 * (values[(m, lb)] or 0.0) for lb in labels]
        heights += ys
        ax.bar([x + i * width - 0.4 + width / 2 for x in range(len(labels))], ys, width, label=m)
    if not any(heights):  # bars of height 0 draw nothing: the chart would look empty, not zero
        say_on(ax, "every value is 0%: no attempt passed")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("percent")
    ax.set_ylim(0, 100)
    ax.set_title(f"{name}: n = {summary_json['n']}, Faster at > {summary_json['fast_threshold']:g}x")
    ax.legend(fontsize=8, ncol=min(len(metrics), 4))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
