"""What each run and arm shows, from metrics rows alone, and the Markdown table.

Per run (the rows of its metrics.jsonl):
* final reward: the mean PrimeEcho reward (`reward/mean`) over the last quarter of the steps that
  report one (at least one step);
* pass rate: episodes with a passing turn / episodes, over the whole run;
* first-turn pass rate: episodes whose first turn passed / episodes;
* repair success rate: repair turns (turns after a failed turn) that passed / repair turns;
* the arm's counter (arms.py), and in the full arm every arm's counter.
Per arm: the mean over seeds and the spread (min–max). A rate with nothing to divide is None ("–").
"""

from __future__ import annotations

from dataclasses import dataclass

from launch.stages.ablate.arms import Arm, Counter
from protocols import metric_keys as mk

Rows = list[dict]


def _sum(rows: Rows, key: str) -> float:
    return sum(float(r.get(key) or 0.0) for r in rows)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def final_reward(rows: Rows) -> float | None:
    rewards = [r[mk.REWARD_MEAN] for r in rows if r.get(mk.REWARD_MEAN) is not None]
    if not rewards:
        return None
    tail = rewards[-max(1, len(rewards) // 4) :]
    return sum(tail) / len(tail)


def run_figures(rows: Rows, counter: Counter | None) -> dict[str, float | None]:
    episodes = _sum(rows, mk.ROLLOUT_SAMPLES)
    passed = sum(float(r.get(mk.REWARD_PASS_RATE) or 0.0) * float(r.get(mk.ROLLOUT_SAMPLES) or 0.0) for r in rows)
    return {
        "final reward": final_reward(rows),
        "pass rate": _ratio(passed, episodes),
        "first-turn pass rate": _ratio(_sum(rows, mk.ROLLOUT_FIRST_TURN_PASSES), episodes),
        "repair success rate": _ratio(_sum(rows, mk.ROLLOUT_REPAIR_TURN_PASSES), _sum(rows, mk.ROLLOUT_REPAIR_TURNS)),
        "counter": None if counter is None else counter.count(rows),
    }


@dataclass(frozen=True)
class Spread:
    mean: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, values: list[float | None]) -> Spread:
        known = [v for v in values if v is not None]
        if not known:
            return cls(None, None, None)
        return cls(sum(known) / len(known), min(known), max(known))

    def cell(self, digits: int = 3) -> str:
        if self.mean is None:
            return "–"
        if self.low == self.high:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ({self.low:.{digits}f}–{self.high:.{digits}f})"


COLUMNS = ("final reward", "pass rate", "first-turn pass rate", "repair success rate")


def arm_figures(runs: list[Rows], arm: Arm) -> dict[str, Spread]:
    """One arm's figures across its seeds' runs."""
    per_run = [run_figures(rows, arm.counter) for rows in runs]
    return {name: Spread.of([f[name] for f in per_run]) for name in (*COLUMNS, "counter")}


def full_counters(runs: list[Rows], arms: list[Arm]) -> dict[str, Spread]:
    """Every other arm's counter in the full arm's runs: what the mechanisms did when all were on."""
    return {a.name: Spread.of([a.counter.count(rows) for rows in runs]) for a in arms if a.counter is not None}


def table(results: dict[str, list[Rows]], arms: list[Arm], *, seeds: int, steps: int) -> str:
    """The Markdown table: one row per arm, mean (min–max) over seeds; the counter column shows the
    arm's own counter, and the full arm's value of the same counter beside it."""
    full = full_counters(results.get("full", []), arms)
    lines = [
        f"Ablation: {seeds} seed{'s' * (seeds != 1)} per arm, {steps} steps each; mean (min–max over seeds).",
        "",
        "| arm | switches off | " + " | ".join(COLUMNS) + " | its counter | counter in full |",
        "|---|---|" + "---|" * len(COLUMNS) + "---|---|",
    ]
    for arm in arms:
        figs = arm_figures(results[arm.name], arm)
        cells = [figs[c].cell() for c in COLUMNS]
        if arm.counter is None:
            counter, in_full = "–", "–"
        else:
            counter = f"{arm.counter.name}: {figs['counter'].cell(1)}"
            in_full = full[arm.name].cell(1) if arm.name in full and "full" in results else "–"
        lines.append(f"| {arm.name} | {arm.switches_off} | " + " | ".join(cells) + f" | {counter} | {in_full} |")
    return "\n".join(lines) + "\n"
