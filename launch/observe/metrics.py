"""A run's metrics stream: one JSON line per logged step in `run_dir/metrics.jsonl`, mirrored to
TensorBoard (`run_dir/tb/`) and, when asked for and installed, to Weights & Biases.

metrics.jsonl is the record of truth: the report and any later analysis read it back with
`read_metrics`, which tolerates a torn last line (a run killed mid-write). Keys are the driver's
(`train/loss`, `verifier/compile`, `eval/pass@4`, ...); every value is a plain float. A row's `step`
is the learner step it belongs to; rollout-side progress rows (`progress/*`, written with or without
learner steps) carry the last step and `progress/elapsed_s`, and TensorBoard plots them against
seconds since the run started (their `tb_step`), since their step may not move for a long time.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Self

from configs import LoggingConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Append-only metrics sink of one run."""

    def __init__(self, run_dir: Path, logging_cfg: LoggingConfig) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS_FILE
        torn = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the log's life; close() closes it
        if torn:  # a killed run left half a line: end it, or the next row would be glued onto it
            self._file.write("\n")
        self._tb = _tensorboard_writer(self.run_dir / "tb") if logging_cfg.tensorboard else None
        self._wandb = _wandb_run(self.run_dir, logging_cfg) if logging_cfg.wandb else None

    def log(self, step: int, values: dict[str, float], *, tb_step: int | None = None) -> None:
        """Record `values` at `step`. Non-finite and non-numeric values are kept in the JSON line as
        null (so a NaN loss is visible there) and left out of TensorBoard / wandb. `tb_step`: the x of
        these values in TensorBoard when it is not `step` (progress rows: seconds since the start)."""
        clean = {k: _as_float(v) for k, v in values.items()}
        row = {"step": int(step), "time": time.time(), **clean}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        finite = {k: v for k, v in clean.items() if v is not None}
        if self._tb is not None:
            for key, value in finite.items():
                self._tb.add_scalar(key, value, global_step=int(step if tb_step is None else tb_step))
            self._tb.flush()
        if self._wandb is not None:  # wandb's step must not go down: progress rows go without one
            self._wandb.log(finite, step=int(step) if tb_step is None else None)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every row of `run_dir/metrics.jsonl` in file order. A line that does not parse (the torn last
    line of a killed run, or stray garbage) is skipped with a warning, never fatal."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: skipping a line that is not JSON (torn write?)", path, number)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            log.warning("%s:%d: skipping a row without an integer step", path, number)
    return rows


def _as_float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _tensorboard_writer(directory: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(directory))


def _wandb_run(run_dir: Path, logging_cfg: LoggingConfig):
    try:
        import wandb
    except ImportError:
        log.warning("logging.wandb is on but wandb is not installed; logging to metrics.jsonl and TensorBoard only")
        return None
    return wandb.init(
        project=logging_cfg.wandb_project,
        entity=logging_cfg.wandb_entity,
        name=logging_cfg.wandb_run_name or logging_cfg.run_name or run_dir.name,
        dir=str(run_dir),
    )
