"""RUN_DIR/summary.json: the run's ledger at its end. Replay's episode ledger (the episode-id invariant
emitted = trained + filtered + pending), its group and retry-buffer totals, the highest weight
version replay saw, the learner's version and step (and the checkpoint it restored from), the
supervisor's restarts, every session of the run (a resumed run has several), the wall time, why the run stopped early (if it did) and every distinct
no-progress warning. `kiln train` prints the wall time and the report reads it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from actors.buffer.health import ReplayHealth
from actors.learner.health import LearnerHealth
from launch.observe.id_check import IdCheck

NO_PROGRESS_STOP = "no progress (algo.stop_after_no_progress_s)"


@dataclass(frozen=True)
class RunSummary:
    replay: ReplayHealth
    learner: LearnerHealth
    id_check: IdCheck  # the no-loss check over independent witnesses (launch/observe/id_check.py)
    sessions: tuple[dict, ...]  # RUN_DIR/sessions.jsonl: every `kiln train` session of the run
    restarts: tuple  # the supervisor's Restart records
    wall_s: float
    stopped_for_no_progress: bool
    warnings: tuple[str, ...]

    def to_json(self) -> dict:
        replay, learner = self.replay, self.learner
        return {
            "episodes": {
                "emitted": replay.emitted,
                "trained": replay.trained,
                "filtered": replay.filtered,
                "filtered_total": replay.filtered_total,
                "pending": replay.pending,
                "invariant_ok": replay.invariant_ok,
            },
            "groups": dataclasses.asdict(replay.groups),
            "highest_version_seen": replay.highest_version_seen,
            "learner": {
                "version": learner.version,
                "step": learner.step,
                "restored_from": learner.restored_from,
                "rolled_back": learner.rolled_back,
            },
            "id_check": self.id_check.to_json(),
            "sessions": list(self.sessions),
            "restarts": [dataclasses.asdict(r) for r in self.restarts],
            "retry": dataclasses.asdict(replay.retry),
            "wall_s": round(self.wall_s, 1),
            "stopped": NO_PROGRESS_STOP if self.stopped_for_no_progress else None,
            "warnings": list(self.warnings),
        }

    def write(self, run_dir: Path) -> dict:
        summary = self.to_json()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
