"""The end-of-run report: `run_dir/report.md` (and `report.html`, the same content with the plots
embedded) with PNG plots in `run_dir/plots/`, from metrics.jsonl, summary.json and the episode dumps'
index.

Sections: the run's figures (its wall time is the one `kiln train` printed: summary.json's `wall_s`),
warnings the run raised (a run that could not learn), the mechanisms table (launch/observe/mechanisms.py:
each mechanism of the algorithm, how often it acted, and the episode dump that shows it), the
validation table, the plots (launch/observe/report_plots.py), what was not recorded, and links to the files.

It must work for a run of a handful of steps and for a run that recorded only some metrics (a
rollout-only run has no loss; a cpu run no compile speedups; a run that never got a batch only
progress rows): every plot draws the series that exist, and the report lists what was not recorded
instead of failing.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

from launch.observe import mechanisms
from launch.observe.episode_dump import read_index
from launch.observe.metrics import read_metrics
from launch.observe.report_doc import Block, Bullets, Heading, Image, Para, Table, to_html, to_markdown
from launch.observe.report_plots import PLOTS, Series, step_series
from launch.observe.words import plural
from launch.stages.eval.table import caption, row_values
from protocols import metric_keys as mk


def write_report(run_dir: Path, *, html: bool = True) -> Path:
    """Write report.md (and report.html, plots/) for the run in `run_dir`; returns report.md's path."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    summary = _read_summary(run_dir)
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    title = f"Kiln run report: {run_dir.name}"
    blocks: list[Block] = [Heading(title, 1)]
    if not rows:
        blocks.append(Para("No metrics were recorded (metrics.jsonl is missing or empty)."))
    else:
        series = step_series(rows)
        terms = Glossary()
        blocks += _summary(rows, series, summary) + terms.explain("PrimeEcho", "MirrorPop", "η")
        blocks += _warnings(summary) + _mechanisms(rows, run_dir) + terms.explain(*mechanisms.GLOSSARY)
        blocks += _eval_table(rows) + _last_eval_levels(run_dir)
        missing: list[str] = []
        for name, draw in PLOTS:
            image, absent = draw(series, rows, run_dir, plots_dir)
            missing += absent
            if image is not None:
                blocks += [
                    Heading(name),
                    *terms.explain(*PLOT_TERMS.get(name, ())),
                    Image(name, image, f"plots/{image.name}"),
                ]
        if missing:
            blocks += [Heading("Not recorded in this run"), Para(", ".join(f"`{k}`" for k in missing))]
    blocks += _links(run_dir)
    path = run_dir / "report.md"
    path.write_text(to_markdown(blocks), encoding="utf-8")
    if html:
        (run_dir / "report.html").write_text(to_html(blocks, title), encoding="utf-8")
    return path


# The terms each plot shows in its titles and legends (launch/observe/report_plots.py).
PLOT_TERMS = {
    "Reward and pass rate": ("PrimeEcho",),
    "Staleness": ("η",),
    "Off-policy corrections and filters": ("ε", "C", "MirrorPop", "Buffered Dynamic Retry"),
}


class Glossary:
    """Explains each term of the algorithm once, in one sentence (mechanisms.GLOSSARY), where the report
    first shows it: `explain(*terms)` is a paragraph of the terms not explained yet ([] when none)."""

    def __init__(self) -> None:
        self.explained: set[str] = set()

    def explain(self, *terms: str) -> list[Block]:
        fresh = [t for t in terms if t not in self.explained]
        self.explained.update(fresh)
        return [Para(" ".join(mechanisms.GLOSSARY[t] for t in fresh))] if fresh else []


# ------------------------------------------------------------------------------------ tables


def _read_summary(run_dir: Path) -> dict:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _last(series: Series, key: str) -> float | None:
    return series[key][-1][1] if series.get(key) else None


def _summary(rows: list[dict], series: Series, summary: dict) -> list[Block]:
    trained = sorted({r["step"] for r in rows if mk.TRAIN_LOSS in r})
    wall = summary.get("wall_s")
    if not isinstance(wall, (int, float)):
        times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
        wall = max(times) - min(times) if times else None
        wall_text = f"{wall:.0f} s (first to last metrics row)" if wall is not None else None
    else:
        wall_text = f"{wall:.0f} s"
    facts = [
        ("learner steps", f"{len(trained)} (steps {trained[0]}..{trained[-1]})" if trained else "none"),
        ("wall time (this session, as `kiln train` printed it)", wall_text),
        ("stopped early", summary.get("stopped")),
        ("sessions", _sessions(summary)),
        ("episode ids (the no-loss check)", _id_check(summary)),
        ("weight versions", _int(_max(series, mk.WEIGHTS_VERSION))),
        ("groups completed", _int(_latest(rows, (mk.PROGRESS_GROUPS, mk.RUN_GROUPS)))),
        ("distinct compiled sources", _int(_last(series, mk.RUN_DISTINCT_SOURCES))),
        ("untied groups (rewards not all equal)", _int(_last(series, mk.RUN_UNTIED_GROUPS))),
        ("final reward mean (PrimeEcho)", _num(_last(series, mk.REWARD_MEAN))),
        ("final pass rate", _num(_last(series, mk.REWARD_PASS_RATE))),
        ("final loss", _num(_last(series, mk.TRAIN_LOSS))),
        ("mean MirrorPop kept fraction", _num(_mean(series, mk.TRAIN_KEPT_FRACTION))),
        ("mean rollout samples/s", _num(_mean(series, mk.ROLLOUT_SAMPLES_PER_S))),
        ("max staleness (versions; at most η)", _int(_max(series, mk.STALENESS_MAX))),
    ]
    return [
        Para(f"Written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from metrics.jsonl."),
        Table(
            ["quantity", "value"],
            [
                [name, value if value is not None else "not recorded"]
                for name, value in facts
                if name not in ("stopped early", "sessions") or value
            ],
        ),
    ]


def _id_check(summary: dict) -> str | None:
    check = summary.get("id_check")
    if not isinstance(check, dict):
        return None
    head = (
        f"{check.get('acked')} acknowledged, {check.get('trained')} trained, {check.get('filtered')} filtered, "
        f"{check.get('pending')} pending"
    )
    if check.get("ok"):
        return f"hold: {head}"
    problems = check.get("problems") or {}
    return f"FAIL: {head}; " + "; ".join(f"{k}: {', '.join(map(str, v))}" for k, v in problems.items())


def _sessions(summary: dict) -> str | None:
    """A resumed run's sessions in one line: which crashed, and what each resume restored and lost."""
    sessions = [s for s in summary.get("sessions") or [] if isinstance(s, dict)]
    if len(sessions) < 2:
        return None
    parts = []
    for s in sessions:
        if "ended" not in s:
            parts.append(f"{s.get('session')}: crashed (no summary)")
            continue
        restored = s.get("restored_from", -1)
        how = f"restored version {restored}" if isinstance(restored, int) and restored >= 0 else "fresh"
        lost = s.get("rolled_back") or 0
        parts.append(
            f"{s.get('session')}: {how}"
            + (f", {lost} version(s) rolled back" if lost else "")
            + f", ended at step {s.get('step')}"
        )
    return f"{len(sessions)} ({'; '.join(parts)})"


def _warnings(summary: dict) -> list[Block]:
    warnings = [w for w in summary.get("warnings") or [] if isinstance(w, str)]
    return [Heading("Warnings"), Bullets(warnings)] if warnings else []


def _mechanisms(rows: list[dict], run_dir: Path) -> list[Block]:
    """Each mechanism, how often it acted, and the first dumped episode that shows it."""
    index = read_index(run_dir)
    table = []
    for m in mechanisms.MECHANISMS:
        n = m.count(rows)
        shown = "-"
        if m.tag is not None:
            first = next((r for r in index if m.tag in r["tags"]), None)
            if first is not None:
                shown = f"[{first['file']}](episodes/{first['file']}) `{first['episode_id']}`"
            elif n:
                shown = "no dump (the episode was not held, or dumps are off)"
        table.append([m.name, plural(n, m.unit) if n else "0", shown])
    return [
        Heading("Mechanisms"),
        Para(
            "How often each mechanism of the algorithm acted in this run, and the episode dump that shows it "
            "(search the file for the episode id)."
        ),
        Table(["mechanism", "acted", "shown in"], table, align=["l", "r", "l"]),
    ]


def _eval_table(rows: list[dict]) -> list[Block]:
    """The MusaCoder model-card columns, one line per validation run, the final one in bold."""
    evals = [r for r in rows if any(k.startswith(mk.EVAL) for k in r)]
    if not evals:
        return [Heading("Validation"), Para("No validation run was recorded (no `eval/*` metrics).")]
    ks = sorted({int(m.group(1)) for r in evals for k in r if (m := re.fullmatch(r"eval/pass@(\d+)", k))})
    ns = sorted({int(m.group(1)) for r in evals for k in r if (m := re.fullmatch(r"eval/avg@(\d+)", k))})
    columns = [(f"pass@{k}", f"{mk.EVAL}pass@{k}") for k in ks] + [(f"avg@{n}", f"{mk.EVAL}avg@{n}") for n in ns]
    columns += [
        ("faster eager", mk.EVAL_FASTER_EAGER),
        ("faster compile", mk.EVAL_FASTER_COMPILE),
        ("tasks", mk.EVAL_TASKS),
    ]
    table = []
    for i, row in enumerate(evals):
        cells = [_num(row.get(key)) or "-" for _, key in columns]
        if i == len(evals) - 1:
            cells = [f"**{c}**" for c in cells]
        table.append([f"{row['step']}{' (final)' if i == len(evals) - 1 else ''}", *cells])
    return [Heading("Validation"), Table(["step", *(c for c, _ in columns)], table)]


def _last_eval_levels(run_dir: Path) -> list[Block]:
    """The newest validation by level, from the summary `kiln eval`'s writer left in
    RUN_DIR/eval/step-N/ (the same numbers as its table.md, levels as rows)."""
    found = sorted((run_dir / "eval").glob("step-*/summary.json")) if (run_dir / "eval").is_dir() else []
    if not found:
        return []
    try:
        summary = json.loads(found[-1].read_text())
        values = row_values(summary)
    except (OSError, ValueError, KeyError, TypeError):
        return [Para(f"The validation summary {found[-1].parent.name}/summary.json could not be read.")]
    metrics = list(dict.fromkeys(metric for metric, _ in values))
    labels = [r["label"] for r in summary["rows"]]
    table = [
        [label, *("n/a" if values[(m, label)] is None else f"{100 * values[(m, label)]:.1f}" for m in metrics)]
        for label in labels
    ]
    return [
        Heading(f"By level ({found[-1].parent.name})", 3),
        Table(["", *metrics], table, align=["l"] + ["r"] * len(metrics)),
        Para(caption(summary)),
    ]


def _links(run_dir: Path) -> list[Block]:
    """Where to read further, for the parts of the run directory that exist."""
    episodes = sorted((run_dir / "episodes").glob("step-*.txt")) if (run_dir / "episodes").is_dir() else []
    episodes = [p for p in episodes if not p.stem.endswith("-end")]  # a session's end adds to its last step
    links = [
        (run_dir / "config.yaml", "the resolved config", "config.yaml"),
        (run_dir / "summary.json", "the episode ledger and run summary", "summary.json"),
        (run_dir / "tb", "TensorBoard events (`tensorboard --logdir tb`)", "tb/"),
        (run_dir / "final", "the final model (HF checkpoint)", "final/"),
    ]
    items = [f"[{name}]({href})" for path, name, href in links if path.exists()]
    if episodes:
        items.append(
            f"episode dumps: {plural(len(episodes), 'step')}, the last is [{episodes[-1].name}](episodes/{episodes[-1].name})"
        )
    return [Heading("Files"), Bullets(items)] if items else []


def _latest(rows: list[dict], keys: tuple[str, ...]) -> float | None:
    """The value of any of `keys` in the latest row (by time) that has one: progress rows and step rows
    come interleaved, and whichever came last counts the most groups."""
    found = [
        (r.get("time") or 0.0, i, r[k]) for i, r in enumerate(rows) for k in keys if isinstance(r.get(k), (int, float))
    ]
    return max(found)[2] if found else None


def _max(series: Series, key: str) -> float | None:
    return max(v for _, v in series[key]) if series.get(key) else None


def _mean(series: Series, key: str) -> float | None:
    return sum(v for _, v in series[key]) / len(series[key]) if series.get(key) else None


def _int(x: float | None) -> str | None:
    return None if x is None else str(int(x))


def _num(x: float | None) -> str | None:
    return None if x is None else f"{x:.4g}"
