"""The metrics stream (launch/observe/metrics.py): metrics.jsonl flushed per line, TensorBoard and W&B
mirrors, a reader that tolerates a torn last line."""

from __future__ import annotations

import importlib.util
import json
import logging
import time

from configs import LoggingConfig
from launch.observe.metrics import MetricsLog, read_metrics


def test_metrics_jsonl_is_flushed_per_line_and_mirrored_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLog(tmp_path, LoggingConfig(tensorboard=True)) as metrics:
        metrics.log(1, {"train/loss": 0.5, "reward/mean": -0.25})
        # Flushed while the log is still open: a crash after this line loses nothing.
        first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] == 1 and first["train/loss"] == 0.5 and first["reward/mean"] == -0.25
        assert abs(first["time"] - time.time()) < 60
        metrics.log(2, {"train/loss": float("nan"), "weights/version": 2, "note": "text"})
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["train/loss"] is None and rows[1]["weights/version"] == 2.0 and rows[1]["note"] is None

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "reward/mean", "weights/version"}
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5)]  # NaN left out
    assert [(e.step, e.value) for e in events.Scalars("weights/version")] == [(2, 2.0)]


def test_tensorboard_off_and_wandb_missing_warns_once(tmp_path, caplog):
    wandb_missing = importlib.util.find_spec("wandb") is None  # (an installed wandb would try to log in)
    with caplog.at_level(logging.WARNING, logger="launch.observe.metrics"):
        metrics = MetricsLog(tmp_path, LoggingConfig(tensorboard=False, wandb=wandb_missing))
        for step in range(3):
            metrics.log(step, {"reward/mean": float(step)})
        metrics.close()
    if wandb_missing:
        warnings = [r for r in caplog.records if "wandb" in r.getMessage()]
        assert len(warnings) == 1
    assert not (tmp_path / "tb").exists()
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [0.0, 1.0, 2.0]


def test_wandb_project_entity_and_run_name_come_from_the_config(tmp_path, monkeypatch):
    import types

    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    )
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)  # wandb is not installed here
    cfg = LoggingConfig(
        tensorboard=False, wandb=True, wandb_project="kernels", wandb_entity="lab", wandb_run_name="relu-sweep-3"
    )
    MetricsLog(tmp_path, cfg).close()
    MetricsLog(tmp_path, LoggingConfig(tensorboard=False, wandb=True, run_name="r7")).close()
    assert calls == [
        {"project": "kernels", "entity": "lab", "name": "relu-sweep-3", "dir": str(tmp_path)},
        {"project": "kiln", "entity": None, "name": "r7", "dir": str(tmp_path)},
    ]


def test_read_metrics_tolerates_a_torn_last_line_and_garbage(tmp_path):
    assert read_metrics(tmp_path) == []
    with MetricsLog(tmp_path, LoggingConfig(tensorboard=False)) as metrics:
        metrics.log(1, {"reward/mean": 1.0})
        metrics.log(2, {"reward/mean": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('[1, 2]\n{"step": "x"}\n\n{"step": 3, "reward/me')  # wrong shapes, then a torn write
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0)]
    # Appending after a restart keeps earlier rows.
    with MetricsLog(tmp_path, LoggingConfig(tensorboard=False)) as metrics:
        metrics.log(4, {"reward/mean": 4.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 4]
