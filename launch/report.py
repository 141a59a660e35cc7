"""The end-of-run report: `run_dir/report.md` with PNG plots in `run_dir/plots/`, from metrics.jsonl.

It must work for a run of a handful of steps and for a run that recorded only some metrics (a
rollout-only run has no loss; a cpu run no compile speedups): every plot draws the series that
exist, and the report lists what was not recorded instead of failing. Plots use matplotlib's Agg
backend (no display needed).
"""

from __future__ import annotations

import re
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from launch.live import STAGES
from launch.metrics import read_metrics

Series = dict[str, list[tuple[int, float]]]  # key -> (step, value) in step order


def write_report(run_dir: Path) -> Path:
    """Write report.md (and plots/) for the run in `run_dir`; returns the report's path."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    series = _series(rows)
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# Kiln run report: {run_dir.name}", ""]
    if not rows:
        lines += ["No metrics were recorded (metrics.jsonl is missing or empty)."]
    else:
        lines += _summary(rows, series) + [""] + _eval_table(rows) + [""] + _last_eval_levels(run_dir)
        missing: list[str] = []
        for title, draw in _PLOTS:
            image, absent = draw(series, plots_dir)
            missing += absent
            if image is not None:
                lines += [f"## {title}", "", f"![{title}](plots/{image.name})", ""]
        if missing:
            lines += ["## Not recorded in this run", "", ", ".join(f"`{k}`" for k in missing), ""]
    lines += _links(run_dir)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------ tables


def _series(rows: list[dict]) -> Series:
    out: Series = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                out[key].append((row["step"], float(value)))
    for points in out.values():
        points.sort(key=lambda p: p[0])
    return out


def _last(series: Series, key: str) -> float | None:
    return series[key][-1][1] if series.get(key) else None


def _summary(rows: list[dict], series: Series) -> list[str]:
    steps = sorted({row["step"] for row in rows})
    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    seconds = max(times) - min(times) if times else None
    facts = [
        ("steps logged", f"{len(steps)} (steps {steps[0]}..{steps[-1]})"),
        ("wall time", f"{seconds:.0f} s" if seconds is not None else None),
        ("weight versions", _int(_max(series, "weights/version"))),
        ("distinct compiled sources", _int(_last(series, "run/distinct_sources"))),
        ("untied groups (rewards not all equal)", _int(_last(series, "run/untied_groups"))),
        ("final reward mean", _num(_last(series, "reward/mean"))),
        ("final pass rate", _num(_last(series, "reward/pass_rate"))),
        ("final loss", _num(_last(series, "train/loss"))),
        ("mean MirrorPop kept fraction", _num(_mean(series, "train/kept_fraction"))),
        ("mean rollout samples/s", _num(_mean(series, "rollout/samples_per_s"))),
        ("max staleness", _int(_max(series, "staleness/max"))),
    ]
    lines = [f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from metrics.jsonl.", "",
             "| quantity | value |", "|---|---|"]
    lines += [f"| {name} | {value if value is not None else 'not recorded'} |" for name, value in facts]
    return lines


def _eval_table(rows: list[dict]) -> list[str]:
    """The MusaCoder model-card columns, one line per validation run, the final one in bold."""
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not evals:
        return ["## Validation", "", "No validation run was recorded (no `eval/*` metrics)."]
    ks = sorted({int(m.group(1)) for r in evals for k in r if (m := re.fullmatch(r"eval/pass@(\d+)", k))})
    ns = sorted({int(m.group(1)) for r in evals for k in r if (m := re.fullmatch(r"eval/avg@(\d+)", k))})
    columns = [(f"pass@{k}", f"eval/pass@{k}") for k in ks] + [(f"avg@{n}", f"eval/avg@{n}") for n in ns]
    columns += [("faster eager", "eval/faster_eager"), ("faster compile", "eval/faster_compile"), ("tasks", "eval/tasks")]
    lines = ["## Validation", "", "| step | " + " | ".join(c for c, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for i, row in enumerate(evals):
        cells = [_num(row.get(key)) or "-" for _, key in columns]
        if i == len(evals) - 1:
            cells = [f"**{c}**" for c in cells]
        lines.append(f"| {row['step']}{' (final)' if i == len(evals) - 1 else ''} | " + " | ".join(cells) + " |")
    return lines


def _last_eval_levels(run_dir: Path) -> list[str]:
    """The newest validation's table by level, as `kiln eval` writes it (RUN_DIR/eval/step-N/table.md)."""
    tables = sorted((run_dir / "eval").glob("step-*/table.md")) if (run_dir / "eval").is_dir() else []
    if not tables:
        return []
    body = tables[-1].read_text().split("\n", 2)[-1].strip()  # without its "# Evaluation" title
    return [f"### By level ({tables[-1].parent.name})", "", body, ""]


def _links(run_dir: Path) -> list[str]:
    """Where to read further, for the parts of the run directory that exist."""
    episodes = sorted((run_dir / "episodes").glob("step-*.txt")) if (run_dir / "episodes").is_dir() else []
    links = [(run_dir / "config.yaml", "the resolved config", "config.yaml"),
             (run_dir / "tb", "TensorBoard events (`tensorboard --logdir tb`)", "tb/"),
             (run_dir / "final", "the final model (HF checkpoint)", "final/")]
    lines = [f"* [{name}]({href})" for path, name, href in links if path.exists()]
    if episodes:
        lines.append(f"* episode dumps: {len(episodes)} steps, the last is "
                     f"[{episodes[-1].name}](episodes/{episodes[-1].name})")
    return ["## Files", ""] + lines + [""] if lines else []


def _max(series: Series, key: str) -> float | None:
    return max(v for _, v in series[key]) if series.get(key) else None


def _mean(series: Series, key: str) -> float | None:
    return sum(v for _, v in series[key]) / len(series[key]) if series.get(key) else None


def _int(x: float | None) -> str | None:
    return None if x is None else str(int(x))


def _num(x: float | None) -> str | None:
    return None if x is None else f"{x:.4g}"


# ------------------------------------------------------------------------------------ plots


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _line_plot(series: Series, plots_dir: Path, name: str, panels: list[list[tuple[str, str]]]):
    """One subplot per panel, each a set of (key, label) lines; keys without data are reported absent."""
    absent = [key for panel in panels for key, _ in panel if not series.get(key)]
    panels = [[(k, label) for k, label in panel if series.get(k)] for panel in panels]
    panels = [p for p in panels if p]
    if not panels:
        return None, absent
    plt = _figure()
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.8 * len(panels)), squeeze=False, sharex=True)
    for ax, panel in zip(axes[:, 0], panels):
        for key, label in panel:
            steps, values = zip(*series[key])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=label)
        ax.legend(loc="best")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("learner step")
    fig.tight_layout()
    path = plots_dir / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, absent


def _plot_reward(series: Series, plots_dir: Path):
    return _line_plot(series, plots_dir, "reward", [
        [("reward/mean", "reward mean")], [("reward/pass_rate", "pass rate")]])


def _plot_training(series: Series, plots_dir: Path):
    return _line_plot(series, plots_dir, "training", [
        [("train/loss", "loss")],
        [("train/grad_norm", "grad norm (before clipping)")],
        [("train/kept_fraction", "MirrorPop kept"), ("train/clip_low_fraction", "clipped low"),
         ("train/clip_high_fraction", "clipped high"), ("train/is_truncated_fraction", "IS weight truncated"),
         ("replay/bdr_share", "BDR share")],
        [("train/entropy", "entropy of sampled positions")],
        [("train/response_length", "response tokens per sequence")]])


def _plot_throughput(series: Series, plots_dir: Path):
    return _line_plot(series, plots_dir, "throughput", [
        [("rollout/samples_per_s", "rollout samples/s")],
        [("rollout/tokens_per_s", "rollout tokens/s"), ("train/tokens_per_s", "learner tokens/s")]])


def _plot_verifier(series: Series, plots_dir: Path):
    """Stacked bars per step: how far each verified attempt got (stage), and failures by class."""
    stage_keys = [f"verifier/{s}" for s in STAGES if s != "passed" and series.get(f"verifier/{s}")]
    error_keys = sorted(k for k in series if k.startswith("verifier/error/"))
    panels = [(keys, title) for keys, title in ((stage_keys, "attempts by furthest stage reached"),
                                                 (error_keys, "failures by error class")) if keys]
    if not panels:
        return None, ["verifier/<stage>"]
    plt = _figure()
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.8 * len(panels)), squeeze=False, sharex=True)
    for ax, (keys, title) in zip(axes[:, 0], panels):
        steps = sorted({s for k in keys for s, _ in series[k]})
        bottom = [0.0] * len(steps)
        for key in keys:
            values = dict(series[key])
            heights = [values.get(s, 0.0) for s in steps]
            ax.bar(steps, heights, 0.8, bottom=bottom, label=key.removeprefix("verifier/").removeprefix("error/"))
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_title(title, fontsize="medium")
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    axes[-1, 0].set_xlabel("learner step")
    fig.tight_layout()
    path = plots_dir / "verifier.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, []


def _plot_staleness(series: Series, plots_dir: Path):
    """Histogram of trained samples by version lag, summed over the run."""
    lags = {int(k.rsplit("_", 1)[1]): sum(v for _, v in series[k])
            for k in series if re.fullmatch(r"staleness/lag_\d+", k)}
    if not lags:
        return None, ["staleness/lag_<k>"]
    plt = _figure()
    fig, ax = plt.subplots(1, 1, figsize=(6, 3))
    ax.bar(sorted(lags), [lags[k] for k in sorted(lags)])
    ax.set_xticks(sorted(lags))
    ax.set_xlabel("version lag of trained samples")
    ax.set_ylabel("samples")
    fig.tight_layout()
    path = plots_dir / "staleness.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, []


_PLOTS = (
    ("Reward and pass rate", _plot_reward),
    ("Verifier outcomes", _plot_verifier),
    ("Throughput", _plot_throughput),
    ("Staleness", _plot_staleness),
    ("Training", _plot_training),
)
