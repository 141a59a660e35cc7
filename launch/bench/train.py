"""One run of the loop for `kiln bench` (part b): `kiln train` as it runs, watched step by step.

`run_loop` runs `launch.driver.train.train` on the config it is given, optionally kills an actor (a Ray
actor dies without a clean stop) once the learner has recorded a given step, and ends the run at a
fixed step (or `stop_after` seconds in, from step 2 on): the driver writes the summary and raises
`StopRun` from its step hook, so no final export or evaluation runs. After each recorded step
`Probe` reads every actor's health (decoded tokens, verifications, real compiles, its process id)
and the CPU time of each actor's process tree, and stamps the time of the reading.

Two clocks: the driver records a step a moment after the learner sent it (it polls), so the
window is measured on the learner's own send times (Metrics.ts), over which samples/s, the
learner's token rates, the busy shares and the Gantt are taken; counters read by the probe (decoded
tokens, verifications, CPU time) are divided by the time between their own readings.

`summarise` turns that into a `LoopResult` over the steady window: from the step that ends the
warm-up to the last one. Rates:

  samples/s          trained sequences per second
  decoded tok/s      tokens the engines decoded (sampled, not forced-and-scored) per second
  rows per step      an engine's decoded tokens ÷ its decode steps: how full its batch was on average
                     (engines that count their steps: the torch engine)
  prefill per token  context tokens an engine's prefill computed ÷ the tokens it decoded; and the
                     context tokens it placed in slots ÷ those it computed (the rows that shared
                     each prefill: a group's attempts admitted together share their prompt's)
  trained tok/s      tokens in the learner's batches per second (prompt + response)
  gradient tok/s     tokens that carried gradient (MirrorPop kept) per second
  verifications/min  verifier replies per minute; the share that were real compiles
  verification s     p50 and p90 of how long a verification held a verifier's worker slot (the
                     verifiers' latency histograms, subtracted between the window's two readings)
  busy               each actor's share of the window inside its recorded spans (RUN_DIR/timeline.jsonl)
  CPU share          CPU time of each actor's process tree ÷ (window × cores); the machine's too
  sync               the learner's weight publish, until every engine received the version

Counters of an actor that restarted start again at zero; `Counters` adds them up across restarts.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field

from actors.verifier.health import LATENCY_BUCKETS, latency_quantile
from configs import KilnConfig
from launch.bench import cpu
from launch.driver.run_dir import RunDirectory
from launch.driver.train import train
from launch.observe.metrics import read_metrics
from launch.observe.timeline import activity_shares, busy_shares, read_timeline
from protocols import metric_keys as mk

log = logging.getLogger(__name__)


class StopRun(Exception):
    """Raised from the step hook to end the run; the summary is already written."""


class Counters:
    """Running totals of counters that restart from zero when their actor does (a new process id, or a
    reading below the last one: all of the new reading is new)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[object, float]] = {}
        self.total: dict[str, float] = {}

    def update(self, key: str, value: float, identity: object = None) -> None:
        last = self._last.get(key)
        if last is None:
            self.total[key] = 0.0  # the first reading is the baseline
        elif last[0] != identity or value < last[1]:
            self.total[key] += value
        else:
            self.total[key] += value - last[1]
        self._last[key] = (identity, value)


@dataclass
class Mark:
    """What the driver read after one recorded learner step."""

    time: float  # when the learner sent the step (its wall clock, like the spans)
    read_at: float  # when the counters below were read (wall clock)
    step: int
    decoded: dict[str, float]  # engine -> decoded tokens since the first mark
    decode_steps: dict[str, float]  # engine -> decode steps since the first mark (engines that count them)
    queued_steps: dict[str, float]  # engine -> of those, the steps taken while requests waited in its queue
    queued_rows: dict[str, float]  # engine -> rows decoded in those steps
    prefilled: dict[str, float]  # engine -> context tokens its prefill computed since the first mark
    placed: dict[str, float]  # engine -> context tokens it wrote into slots since the first mark
    verified: dict[str, float]  # verifier -> replies since the first mark
    compiled: dict[str, float]  # verifier -> real compiles since the first mark
    latency: list[float]  # verifications since the first mark per latency bucket, all verifiers together
    cpu: dict[str, float] | None  # actor (or "driver") -> CPU seconds since the first mark
    machine_cpu: float | None  # the whole machine's busy CPU seconds (all users)


@dataclass
class Probe:
    kill: tuple[str, int] | None = None
    last_step: int | None = None  # end the run once this step is recorded
    stop_at: float | None = None  # monotonic time after which the next recorded step (from step 2) ends the run
    marks: list[Mark] = field(default_factory=list)
    killed_at: float | None = None  # wall clock
    _counts: Counters = field(default_factory=Counters)
    _cpu: Counters = field(default_factory=Counters)

    def __call__(self, session, step: int) -> None:
        self.marks.append(self._mark(session, step))
        if self.kill is not None and step >= self.kill[1] and self.killed_at is None:
            session.supervisor[self.kill[0]].kill()
            self.killed_at = time.time()
        stopped = self.stop_at is not None and time.monotonic() >= self.stop_at and len(self.marks) >= 2
        if stopped or (self.last_step is not None and step >= self.last_step):
            session.write_summary()  # the ledger as of this step; train() will not reach its own
            raise StopRun

    def _mark(self, session, step: int) -> Mark:
        decoded, decode_steps, verified, compiled, pids = {}, {}, {}, {}, {"driver": os.getpid()}
        queued_steps, queued_rows, prefilled, placed = {}, {}, {}, {}
        latency = [0.0] * LATENCY_BUCKETS
        for name, handle in list(session.supervisor.handles.items()):
            try:
                health = handle.health(timeout_s=10.0)
            except Exception:  # noqa: BLE001, S112 - dead or wedged: the supervisor deals with it
                continue
            pids[name] = health.pid
            if name.startswith("rollout-"):
                self._counts.update(f"decoded/{name}", health.decoded_tokens, health.pid)
                decoded[name] = self._counts.total[f"decoded/{name}"]
                if health.engine is not None:  # an engine that does not count its steps reports 0
                    self._counts.update(f"steps/{name}", health.engine.steps, health.pid)
                    decode_steps[name] = self._counts.total[f"steps/{name}"]
                    for kind, value, out in (
                        ("queued_steps", health.engine.queued_steps, queued_steps),
                        ("queued_rows", health.engine.queued_rows, queued_rows),
                        ("prefilled", health.engine.prefilled, prefilled),
                        ("placed", health.engine.placed, placed),
                    ):
                        self._counts.update(f"{kind}/{name}", value, health.pid)
                        out[name] = self._counts.total[f"{kind}/{name}"]
            elif name.startswith("verifier-"):
                for kind, value, out in (
                    ("verified", health.replied, verified),
                    ("compiled", health.compiled, compiled),
                ):
                    self._counts.update(f"{kind}/{name}", value, health.pid)
                    out[name] = self._counts.total[f"{kind}/{name}"]
                for bucket, count in enumerate(health.latency_counts):
                    self._counts.update(f"latency/{name}/{bucket}", count, health.pid)
                    latency[bucket] += self._counts.total[f"latency/{name}/{bucket}"]
        cpu_s, machine = self._cpu_reading(pids), cpu.machine_busy_s()
        return Mark(
            time=session.monitor.step_times.get(step, time.time()),
            read_at=time.time(),
            step=step,
            decoded=decoded,
            decode_steps=decode_steps,
            queued_steps=queued_steps,
            queued_rows=queued_rows,
            prefilled=prefilled,
            placed=placed,
            verified=verified,
            compiled=compiled,
            latency=latency,
            cpu=cpu_s,
            machine_cpu=machine,
        )

    def _cpu_reading(self, pids: dict[str, int]) -> dict[str, float] | None:
        if len(set(pids.values())) == 1:  # in-process: one process holds every stage, none is separable
            pids = {"in-process": os.getpid()}
        reading = cpu.tree_cpu_s(pids, alone=frozenset({"driver"}))
        if reading is None:
            return None
        for name, seconds in reading.items():
            self._cpu.update(name, seconds, pids[name])
        return {name: self._cpu.total[name] for name in reading}


@dataclass
class LoopResult:
    eta: int  # algo.max_staleness of this run
    run_dir: str
    steps: int  # learner steps recorded in the whole run
    window_steps: int  # learner steps inside the window
    window: tuple[float, float]  # wall-clock start and end of the window
    step_times: list[tuple[int, float]]  # (step, wall clock when the driver recorded it) inside the window
    window_s: float
    wall_s: float
    samples_per_s: float
    decoded_tokens_per_s: float
    trained_tokens_per_s: float
    gradient_tokens_per_s: float
    trained_samples: int  # in the window
    decoded_tokens: float  # in the window
    decoded_per_engine: dict[str, float]  # engine -> decoded tok/s
    counters_s: float  # the time between the counters' readings that the rates of counters divide by
    verifications: float  # in the window
    verifications_per_min: dict[str, float]  # verifier -> replies per minute
    compiled_share: float | None  # of the window's verifications, real compiles
    verify_s: dict[str, float]  # p50 and p90 of the window's verification latencies (s), and n
    learner_step_s_median: float
    sync_s: dict[str, float]  # p50, p99, max over the window's steps, and n
    busy: dict[str, float]  # actor -> share of the window inside its spans
    activities: dict[str, dict[str, float]]  # actor -> activity -> share of the window
    cpu_share: dict[str, float] | None  # actor, "driver", "machine" -> CPU seconds ÷ (window × cores)
    cores: int
    staleness: dict[str, int]  # lag -> samples trained in the window
    restarts: list[str]
    versions_monotonic: bool
    episodes: dict
    id_check: dict  # the no-loss check over independent witnesses (launch/observe/id_check.py)
    killed: str | None
    recovery_s: float | None  # kill -> the next learner step recorded
    finished: bool  # False when stop_after ended the run before its last step
    # engine -> decoded tokens ÷ decode steps in the window: its mean batch fill (of rollout.max_batch)
    rows_per_step: dict[str, float] = field(default_factory=dict)
    # engine -> the same over the steps taken while requests waited in its queue (none waited: absent)
    rows_per_queued_step: dict[str, float] = field(default_factory=dict)
    # engine -> context tokens its prefill computed ÷ tokens it decoded in the window
    prefill_per_decoded: dict[str, float] = field(default_factory=dict)
    # engine -> context tokens placed in slots ÷ those its prefill computed (rows sharing a prefill)
    placed_per_prefilled: dict[str, float] = field(default_factory=dict)


def run_loop(
    cfg: KilnConfig,
    run: RunDirectory,
    *,
    warmup: int,
    steps: int | None,
    kill: tuple[str, int] | None = None,
    stop_after: float | None = None,
) -> LoopResult:
    """Run the loop on `cfg` in `run`; `steps` after `warmup` steps (None: until algo.total_steps)."""
    started, started_wall = time.monotonic(), time.time()
    last = warmup + steps if steps is not None else None
    probe = Probe(kill=kill, last_step=last, stop_at=None if stop_after is None else started + stop_after)
    finished = True
    try:
        train(cfg, run, on_step=probe)
    except StopRun:
        finished = last is not None and probe.marks[-1].step >= last
    return summarise(cfg, run, probe, warmup, time.time() - started_wall, kill, finished)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarise(
    cfg: KilnConfig,
    run: RunDirectory,
    probe: Probe,
    warmup: int,
    wall_s: float,
    kill: tuple[str, int] | None,
    finished: bool,
) -> LoopResult:
    if len(probe.marks) < 2:
        raise RuntimeError(f"{run.path}: fewer than two learner steps were recorded; no window to measure")
    start = next((m for m in probe.marks if m.step >= warmup), probe.marks[0])
    if start is probe.marks[-1]:
        start = probe.marks[-2]
    end = probe.marks[-1]
    t0, t1 = start.time, end.time
    window = max(t1 - t0, 1e-9)
    between = max(end.read_at - start.read_at, 1e-9)
    rows = [r for r in read_metrics(run.path) if mk.TRAIN_LOSS in r]
    steady = [r for r in rows if start.step < r["step"] <= end.step]
    summary = json.loads((run.path / "summary.json").read_text())
    versions = [int(r[mk.WEIGHTS_VERSION]) for r in rows if mk.WEIGHTS_VERSION in r]
    spans = read_timeline(run.path)
    delta = lambda a, b: {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
    decoded = delta(end.decoded, start.decoded)
    decode_steps = {k: v for k, v in delta(end.decode_steps, start.decode_steps).items() if v > 0}
    queued_steps = {k: v for k, v in delta(end.queued_steps, start.queued_steps).items() if v > 0}
    queued_rows = delta(end.queued_rows, start.queued_rows)
    prefilled = {k: v for k, v in delta(end.prefilled, start.prefilled).items() if v > 0}
    placed = delta(end.placed, start.placed)
    verified = delta(end.verified, start.verified)
    compiled = delta(end.compiled, start.compiled)
    verifications = sum(verified.values())
    latency = [b - a for a, b in zip(start.latency, end.latency, strict=True)]
    cpu_share = None
    if end.cpu is not None and start.cpu is not None:
        cores = cpu.cores()
        cpu_share = {k: v / (between * cores) for k, v in delta(end.cpu, start.cpu).items()}
        if end.machine_cpu is not None and start.machine_cpu is not None:
            cpu_share["machine"] = (end.machine_cpu - start.machine_cpu) / (between * cores)
    syncs = [float(r.get(mk.WEIGHTS_SYNC_S, 0.0)) for r in steady] or [0.0]
    lags: dict[str, int] = {}
    for r in steady:
        for key, value in r.items():
            if key.startswith(mk.STALENESS_LAG):
                lag = key.removeprefix(mk.STALENESS_LAG)
                lags[lag] = lags.get(lag, 0) + int(value)
    samples = sum(r.get(mk.TRAIN_SEQUENCES, 0.0) for r in steady)
    recovery = None
    if probe.killed_at is not None:
        after = [m.read_at for m in probe.marks if m.read_at > probe.killed_at]
        recovery = after[0] - probe.killed_at if after else None
    return LoopResult(
        eta=cfg.algo.max_staleness,
        run_dir=str(run.path),
        steps=len(rows),
        window_steps=len(steady),
        window=(t0, t1),
        step_times=[(m.step, m.time) for m in probe.marks if start.step <= m.step <= end.step],
        window_s=window,
        wall_s=wall_s,
        samples_per_s=samples / window,
        decoded_tokens_per_s=sum(decoded.values()) / between,
        trained_tokens_per_s=sum(r.get(mk.TRAIN_TOKENS, 0.0) for r in steady) / window,
        gradient_tokens_per_s=sum(r.get(mk.TRAIN_TRAINED_TOKENS, 0.0) for r in steady) / window,
        trained_samples=int(samples),
        decoded_tokens=sum(decoded.values()),
        decoded_per_engine={k: v / between for k, v in sorted(decoded.items())},
        counters_s=between,
        rows_per_step={k: decoded.get(k, 0.0) / n for k, n in sorted(decode_steps.items())},
        rows_per_queued_step={k: queued_rows.get(k, 0.0) / n for k, n in sorted(queued_steps.items())},
        prefill_per_decoded={k: n / decoded[k] for k, n in sorted(prefilled.items()) if decoded.get(k)},
        placed_per_prefilled={k: placed.get(k, 0.0) / n for k, n in sorted(prefilled.items())},
        verifications=verifications,
        verifications_per_min={k: 60.0 * v / between for k, v in sorted(verified.items())},
        compiled_share=sum(compiled.values()) / verifications if verifications else None,
        verify_s={
            "p50": latency_quantile(latency, 0.5) or 0.0,
            "p90": latency_quantile(latency, 0.9) or 0.0,
            "n": float(sum(latency)),
        },
        learner_step_s_median=statistics.median(r[mk.TRAIN_STEP_S] for r in (steady or rows)),
        sync_s={
            "p50": _percentile(syncs, 0.5),
            "p99": _percentile(syncs, 0.99),
            "max": max(syncs),
            "n": float(len(steady)),
        },
        busy=busy_shares(spans, t0, t1),
        activities=activity_shares(spans, t0, t1),
        cpu_share=cpu_share,
        cores=cpu.cores(),
        staleness=dict(sorted(lags.items(), key=lambda kv: int(kv[0]))),
        restarts=[r["actor"] for r in summary["restarts"]],
        versions_monotonic=versions == sorted(set(versions)),
        episodes=summary["episodes"],
        id_check=summary.get("id_check", {}),
        killed=f"{kill[0]} at step {kill[1]}" if kill else None,
        recovery_s=recovery,
        finished=finished,
    )
