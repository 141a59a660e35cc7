"""A run's directory: where everything a run writes lives, so it can be inspected and resumed.

RUN_DIR/config.yaml        the resolved config (what `--resume` reloads)
RUN_DIR/metrics.jsonl      one row per learner step (+ eval rows); tb/ TensorBoard events
RUN_DIR/timeline.jsonl     the actors' spans of work (generating, verifying, training, syncing)
RUN_DIR/episodes/          sampled episodes as readable text, one file per step
RUN_DIR/registry.json      every running actor's endpoints (the address registry)
RUN_DIR/logs/              each Ray actor's log (NAME.log, at logging.level; a replacement appends)
RUN_DIR/replay/            replay's write-ahead log and snapshots
RUN_DIR/learner/           the learner's highest announced version
RUN_DIR/checkpoints/       learner checkpoints; weights/ the disk weight transport
RUN_DIR/final/             the final model as an HF checkpoint
RUN_DIR/sessions.jsonl     each `kiln train` session of the run: when it started and, if it ended
                           cleanly, what it ended with (a session with no end line crashed)
RUN_DIR/report.md          the report, with plots/
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from configs import KilnConfig, to_yaml


@dataclass(frozen=True)
class RunDirectory:
    path: Path

    @classmethod
    def create(cls, cfg: KilnConfig) -> RunDirectory:
        name = cfg.logging.run_name or time.strftime("%Y%m%d-%H%M%S")
        path = Path(cfg.logging.root) / name
        if (path / "config.yaml").exists():
            raise FileExistsError(
                f"{path} already holds a run; use `kiln train --resume {path}` or another logging.run_name"
            )
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.yaml").write_text(to_yaml(cfg))
        return cls(path)

    @classmethod
    def open(cls, path: Path) -> RunDirectory:
        if not (path / "config.yaml").is_file():
            raise FileNotFoundError(f"{path} is not a Kiln run directory (no config.yaml)")
        return cls(path)

    @property
    def sessions_path(self) -> Path:
        return self.path / "sessions.jsonl"

    def begin_session(self) -> int:
        """Record a session's start; returns its number (1 for a new run, 2 for its first resume...)."""
        number = 1 + max((s["session"] for s in self.sessions()), default=0)
        self._append_session({"session": number, "started": round(time.time(), 3)})
        return number

    def end_session(self, number: int, facts: dict) -> None:
        """Record how session `number` ended (it wrote its summary): `facts` are the learner's figures."""
        self._append_session({"session": number, "ended": round(time.time(), 3), **facts})

    def sessions(self) -> list[dict]:
        """Every session of the run in order, its start and end lines merged; a session whose line was
        torn by a crash mid-write is skipped."""
        merged: dict[int, dict] = {}
        try:
            lines = self.sessions_path.read_text().splitlines()
        except OSError:
            return []
        for line in lines:
            try:
                entry = json.loads(line)
                merged.setdefault(int(entry["session"]), {}).update(entry)
            except (ValueError, KeyError, TypeError):
                continue
        return [merged[n] for n in sorted(merged)]

    def _append_session(self, entry: dict) -> None:
        with self.sessions_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def episode_log(self) -> Path:
        return self.path / "episodes_log"

    @property
    def final_model(self) -> Path:
        return self.path / "final"

    def replace_final(self, write: Callable[[Path], None]) -> Path:
        """RUN_DIR/final/ written by `write(directory)` into a fresh directory first: a resumed run
        replaces the earlier export only once the new one is complete."""
        final = self.final_model
        fresh = final.with_name(f"{final.name}.new-{int(time.time())}")
        write(fresh)
        if final.exists():
            old = final.with_name(f"{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            fresh.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            fresh.rename(final)
        return final
