"""Throughput of a whole `kiln train` run, for async-RL systems benchmarks (docs/BENCHMARKS.md).

    python -m launch.bench.train --config configs/four_gpu.yaml [--kill rollout-0@5] [--json F] [k=v ...]

Runs `launch.train.train` as `kiln train` does, optionally kills an actor (a Ray actor dies without a
clean stop) once the learner has recorded a given step, and summarises the run from its metrics and
summary.json. Rates are over the steady window, from the first recorded learner step to the last
(start-up, model builds and the first compiles are outside it):

  samples/s        trained sequences per second
  generated tok/s  tokens the engines decoded (sampled, not forced-and-scored) per second
  trained tok/s    tokens in the learner's batches per second (prompt + response)
  sync             the learner's weight publish, until every engine received the version
  busy             each actor's share of the window spent working (its busy_s counter)

Run it once with replay.max_staleness=0 and once with η ≥ 1 for the async/sync ratio.

`--stop-after S` ends the run at the first step recorded S seconds or more after the start (and not
before step 2, so that there is a window), for benchmarks under a wall-clock budget: the table then
covers the steps recorded so far and says that the run was stopped. The learner is not checkpointed
and no final export is written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from configs import load_config
from launch.metrics import read_metrics
from launch.run_dir import RunDirectory
from launch.train import train


class StopRun(Exception):
    """Raised from the step hook to end the run at `--stop-after`; the summary is already written."""


@dataclass
class Probe:
    """What the driver sees after each recorded step: time, decoded tokens, the kill to inject."""

    kill: tuple[str, int] | None
    stop_at: float | None = None  # monotonic time after which the next recorded step ends the run
    marks: list[tuple[float, int, int]] = field(default_factory=list)  # (monotonic s, step, decoded tokens)
    killed_at: float | None = None
    _decoded: dict[str, tuple[int, int]] = field(default_factory=dict)  # actor -> (last seen, total)

    def __call__(self, session, step: int) -> None:
        self.marks.append((time.monotonic(), step, self._decoded_tokens(session)))
        if self.kill is not None and step >= self.kill[1] and self.killed_at is None:
            session.supervisor[self.kill[0]].kill()
            self.killed_at = time.monotonic()
        if self.stop_at is not None and time.monotonic() >= self.stop_at and len(self.marks) >= 2:
            session.write_summary()  # the ledger as of this step; train() will not reach its own
            raise StopRun

    def _decoded_tokens(self, session) -> int:
        """Tokens decoded by all engines so far; a restarted engine's counter starts again at 0."""
        for handle in session.rollouts:
            try:
                now = handle.health(timeout_s=10.0).decoded_tokens
            except Exception:
                continue
            last, total = self._decoded.get(handle.name, (0, 0))
            total += now - last if now >= last else now
            self._decoded[handle.name] = (now, total)
        return sum(total for _, total in self._decoded.values())


@dataclass
class BenchResult:
    steps: int
    wall_s: float
    window_s: float
    samples_per_s: float
    generated_tokens_per_s: float
    trained_tokens_per_s: float
    grad_tokens_per_s: float
    learner_step_s_median: float
    sync_s_median: float
    sync_s_max: float
    busy: dict[str, float]
    staleness: dict[str, float]
    restarts: list[str]
    versions_monotonic: bool
    episodes: dict
    killed: str | None
    recovery_s: float | None  # kill -> the next learner step recorded
    finished: bool  # False when --stop-after ended the run before algo.total_steps


def summarise(run: RunDirectory, probe: Probe, wall_s: float, kill: tuple[str, int] | None,
              finished: bool = True) -> BenchResult:
    rows = [r for r in read_metrics(run.path) if "train/loss" in r]
    summary = json.loads((run.path / "summary.json").read_text())
    (t0, first, tok0), (t1, last, tok1) = probe.marks[0], probe.marks[-1]
    window = max(t1 - t0, 1e-9)
    steady = [r for r in rows if first < r["step"] <= last]
    versions = [int(r["weights/version"]) for r in rows if "weights/version" in r]
    busy_names = sorted({k for r in steady for k in r if k.startswith("busy/")})
    lags = {k: sum(r.get(k, 0.0) for r in rows) for k in sorted({k for r in rows for k in r
                                                                 if k.startswith("staleness/lag_")})}
    recovery = None
    if probe.killed_at is not None:
        after = [t for t, _, _ in probe.marks if t > probe.killed_at]
        recovery = after[0] - probe.killed_at if after else None
    return BenchResult(
        steps=len(rows), wall_s=wall_s, window_s=window,
        samples_per_s=sum(r.get("train/sequences", 0.0) for r in steady) / window,
        generated_tokens_per_s=(tok1 - tok0) / window,
        trained_tokens_per_s=sum(r.get("train/tokens", 0.0) for r in steady) / window,
        grad_tokens_per_s=sum(r.get("train/trained_tokens", 0.0) for r in steady) / window,
        learner_step_s_median=statistics.median(r["train/step_s"] for r in rows),
        sync_s_median=statistics.median(r.get("weights/sync_s", 0.0) for r in rows),
        sync_s_max=max(r.get("weights/sync_s", 0.0) for r in rows),
        busy={k.removeprefix("busy/"): statistics.fmean(r[k] for r in steady if k in r) for k in busy_names},
        staleness=lags,
        restarts=[r["actor"] for r in summary["restarts"]],
        versions_monotonic=versions == sorted(set(versions)),
        episodes=summary["episodes"],
        killed=f"{kill[0]} at step {kill[1]}" if kill else None,
        recovery_s=recovery, finished=finished)


def render(r: BenchResult) -> str:
    lines = [f"| metric | value |", "| --- | --- |"]
    for name, value in [
        ("learner steps", r.steps if r.finished else f"{r.steps} (stopped by --stop-after)"),
        ("wall s (whole run)", f"{r.wall_s:.0f}"),
        ("steady window s", f"{r.window_s:.1f}"), ("samples/s (trained)", f"{r.samples_per_s:.2f}"),
        ("generated tok/s", f"{r.generated_tokens_per_s:,.0f}"), ("trained tok/s", f"{r.trained_tokens_per_s:,.0f}"),
        ("gradient tok/s", f"{r.grad_tokens_per_s:,.0f}"), ("learner step s (median)", f"{r.learner_step_s_median:.2f}"),
        ("weight sync s (median / max)", f"{r.sync_s_median:.3f} / {r.sync_s_max:.3f}"),
        *((f"busy {name}", f"{v:.2f}") for name, v in r.busy.items()),
        ("staleness (trained samples by lag)", ", ".join(f"{k.removeprefix('staleness/')}: {v:.0f}"
                                                         for k, v in r.staleness.items())),
        ("killed", r.killed or "-"), ("kill -> next step s", "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"),
        ("restarts", ", ".join(r.restarts) or "-"), ("versions only grow", r.versions_monotonic),
        ("episodes emitted = trained + filtered + pending",
         f"{r.episodes['emitted']} = {r.episodes['trained']} + {r.episodes['filtered_total']} + "
         f"{r.episodes['pending']} ({'holds' if r.episodes['invariant_ok'] else 'BROKEN'})"),
    ]:
        lines.append(f"| {name} | {value} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.bench.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--kill", metavar="ACTOR@STEP", help="kill this actor once the learner recorded STEP")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.add_argument("--stop-after", metavar="S", type=float,
                   help="end the run at the first step recorded S seconds after the start (from step 2)")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_intermixed_args(argv)
    kill = None
    if args.kill:
        actor, _, step = args.kill.rpartition("@")
        if not actor or not step.isdigit():
            p.error(f"--kill wants ACTOR@STEP, got {args.kill!r}")
        kill = (actor, int(step))
    cfg = load_config(args.config, args.overrides + ["logging.live=false"])
    import logging

    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = RunDirectory.create(cfg)
    started = time.monotonic()
    probe = Probe(kill=kill, stop_at=None if args.stop_after is None else started + args.stop_after)
    try:
        train(cfg, run, on_step=probe)
        finished = True
    except StopRun:
        finished = False
    result = summarise(run, probe, time.monotonic() - started, kill, finished)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
