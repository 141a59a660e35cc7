"""`kiln sft`'s short report: OUT/report.md with the figures of the run and the loss curve
(OUT/plots/loss.png: the training loss per step and the held-out loss where measured), read back
from OUT/metrics.jsonl so a resumed run's report covers every session. Plots use matplotlib's Agg
backend; without matplotlib the report says so and keeps the figures.
"""

from __future__ import annotations

from pathlib import Path

from launch.observe.metrics import read_metrics
from launch.observe.words import say_on, thin_data_note
from protocols import metric_keys as mk


def write_report(out: Path, header: list[str]) -> Path:
    rows = read_metrics(out)
    train = [(r["step"], r[mk.SFT_LOSS]) for r in rows if r.get(mk.SFT_LOSS) is not None]
    held = [(r["step"], r[mk.SFT_HELDOUT_LOSS]) for r in rows if r.get(mk.SFT_HELDOUT_LOSS) is not None]
    lines = ["# kiln sft", "", *[f"- {h}" for h in header if h], ""]
    lines += ["| | first | last |", "| --- | --- | --- |"]
    if train:
        lines.append(
            f"| training loss (nats/token, assistant tokens) | {train[0][1]:.4f} (step {train[0][0]}) "
            f"| {train[-1][1]:.4f} (step {train[-1][0]}) |"
        )
    if held:
        lines.append(
            f"| held-out loss | {held[0][1]:.4f} (step {held[0][0]}) | {held[-1][1]:.4f} (step {held[-1][0]}) |"
        )
    lines.append("")
    plot = _plot(out, train, held)
    lines.append(f"![loss]({plot.relative_to(out)})" if plot else "(no loss plot: matplotlib is not installed)")
    lines += [
        "",
        (
            "Files: `metrics.jsonl` (one row per step), `tb/` (TensorBoard, when installed), "
            "`final/` (servable HF export), `exports/`, `checkpoints/` (resume)."
        ),
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _plot(out: Path, train: list[tuple[int, float]], held: list[tuple[int, float]]) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:  # a marker, or a one-step run's single point is not drawn at all
        ax.plot(*zip(*train, strict=True), marker="o" if len(train) < 30 else None, label="training loss")
    if held:
        ax.plot(*zip(*held, strict=True), marker="o", label="held-out loss")
    say_on(ax, thin_data_note(train + held))
    ax.set_xlabel("step")
    ax.set_ylabel("nats / assistant token")
    ax.legend()
    fig.tight_layout()
    path = out / "plots" / "loss.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
