"""What `kiln bench` reports, computed from the stages alone and the loop runs: occupancy, the
ideal-overlap bound, the async/sync speedup; and the report's two forms, a Markdown table and JSON.

Occupancy: a stage's rate in the loop over its rate alone. For an engine, its decoded tok/s in the
loop ÷ the engine's decoded tok/s alone; for a verifier, its verifications per minute in the loop ÷
one verifier actor's capacity alone.

The ideal-overlap bound is what the loop would reach if every stage ran at its capacity alone, all
at once (perfect overlap): the slowest stage's capacity, in trained samples per second. Each stage's
capacity is its rate alone divided by what one trained sample demands of it, measured in the loop
runs (all of them pooled, so the bound is one figure for the workload):

  engines    engines × decoded tok/s alone ÷ decoded tokens per trained sample
  verifiers  verifications/s alone ÷ verifications per trained sample
  learner    sequences per batch ÷ (step time alone + weight-sync publish alone): the learner waits
             for its publish before its next step

A run's fraction of the bound is its samples/s over the bound. On a machine whose stages share CPU
cores the bound is optimistic: it assumes each stage gets, in the loop, the cores it had alone (the
CPU shares in the report show what each got).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from launch.bench.stages import Stages
from launch.bench.train import LoopResult


@dataclass
class StageBound:
    stage: str
    capacity: float  # the stage's rate alone, in its own unit
    unit: str
    demand: float  # per trained sample, in the same unit's quantity (tokens, verifications, sequences)
    samples_per_s: float  # capacity ÷ demand; inf when the loop demands nothing of it


@dataclass
class Bound:
    samples_per_s: float
    bottleneck: str
    stages: list[StageBound]


@dataclass
class BenchReport:
    config: str
    command: str
    date: str
    device: str
    load_average: tuple[float, float, float] | None  # at the start of the bench
    stages: Stages | None
    loops: list[LoopResult]
    occupancy: dict[str, dict[str, float]] = field(default_factory=dict)  # "eta=N" -> actor -> occupancy
    bound: Bound | None = None
    bound_fraction: dict[str, float] = field(default_factory=dict)  # "eta=N" -> samples/s ÷ bound
    speedup: dict[str, float] = field(default_factory=dict)  # "eta=N" -> samples/s ÷ the η = 0 run's
    async_sync_speedup: float | None = None  # the best async run's speedup
    gantt: str = ""
    warmup: int = 0
    steps: int | None = None


def occupancy(loop: LoopResult, stages: Stages) -> dict[str, float]:
    out = {}
    for engine, rate in loop.decoded_per_engine.items():
        if stages.engine.decoded_tokens_per_s > 0:
            out[engine] = rate / stages.engine.decoded_tokens_per_s
    for verifier, per_min in loop.verifications_per_min.items():
        if stages.verifier.per_actor_per_min > 0:
            out[verifier] = per_min / stages.verifier.per_actor_per_min
    return out


def ideal_bound(stages: Stages, loops: list[LoopResult], engines: int, batch_sequences: int) -> Bound | None:
    samples = sum(loop.trained_samples for loop in loops)
    if not samples:
        return None
    decoded = sum(loop.decoded_tokens for loop in loops) / samples
    verifications = sum(loop.verifications for loop in loops) / samples
    learner_s = stages.learner.step_s_median + stages.sync.publish_s_median

    def bound(stage: str, capacity: float, unit: str, demand: float) -> StageBound:
        return StageBound(stage, capacity, unit, demand, capacity / demand if demand > 0 else math.inf)

    rows = [
        bound("engines", engines * stages.engine.decoded_tokens_per_s, "decoded tok/s", decoded),
        bound("verifiers", stages.verifier.verifications_per_min / 60.0, "verifications/s", verifications),
        bound("learner", batch_sequences / learner_s, "sequences/s", 1.0),
    ]
    slowest = min(rows, key=lambda r: r.samples_per_s)
    return Bound(samples_per_s=slowest.samples_per_s, bottleneck=slowest.stage, stages=rows)


def complete(report: BenchReport, engines: int, batch_sequences: int) -> BenchReport:
    """Fill in the figures derived from the stages and the loop runs."""
    sync = next((loop for loop in report.loops if loop.eta == 0), None)
    for loop in report.loops:
        key = f"eta={loop.eta}"
        if report.stages is not None:
            report.occupancy[key] = occupancy(loop, report.stages)
        if sync is not None and loop is not sync and sync.samples_per_s > 0:
            report.speedup[key] = loop.samples_per_s / sync.samples_per_s
    if report.speedup:
        report.async_sync_speedup = max(report.speedup.values())
    if report.stages is not None:
        report.bound = ideal_bound(report.stages, report.loops, engines, batch_sequences)
        if report.bound is not None and report.bound.samples_per_s > 0:
            report.bound_fraction = {
                f"eta={loop.eta}": loop.samples_per_s / report.bound.samples_per_s for loop in report.loops
            }
    return report


# -------------------------------------------------------------------------------------- table


def _f(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "∞"
    return f"{value:,.{digits}f}"


def render(report: BenchReport) -> str:
    lines = [
        f"## kiln bench {report.config}",
        "",
        f"* command: `{report.command}`",
        f"* date: {report.date}; device: {report.device}",
        f"* load average at the start: {', '.join(f'{x:.2f}' for x in report.load_average)}"
        if report.load_average
        else "* load average: -",
        (
            f"* loop runs: {report.warmup} warm-up step(s), then "
            f"{report.steps if report.steps is not None else 'until algo.total_steps'} measured"
        ),
    ]
    if report.stages is not None:
        lines += ["", *render_stages(report.stages)]
    if report.loops:
        lines += ["", *render_loops(report)]
    if report.bound is not None:
        lines += ["", *render_bound(report.bound)]
    if report.gantt:
        lines += ["", f"Gantt timeline: {report.gantt}"]
    return "\n".join(lines)


def _yardsticks(e) -> list[str]:
    """The engine's yardsticks as table rows (none where they were not measured)."""
    y = e.yardsticks
    if y is None:
        return []
    hf = (
        f"| HF generate (same run) | {_f(y.hf_generate_tokens_per_s, 1)} decoded tok/s: the engine "
        f"{e.decoded_tokens_per_s / y.hf_generate_tokens_per_s:.2f}× | dynamic cache, eager, HF sdpa, the same "
        f"model; {y.hf_batch} prompts × {y.hf_new_tokens} new tokens in {y.hf_seconds:.1f} s |"
    )
    if y.hf_static_tokens_per_s:
        static = (
            f"| HF generate, static cache + torch.compile (same run) | {_f(y.hf_static_tokens_per_s, 1)} decoded "
            f"tok/s: the engine {e.decoded_tokens_per_s / y.hf_static_tokens_per_s:.2f}× | the same prompts and "
            f"tokens; compiled by transformers, timed after one run of the same shape |"
        )
    else:
        static = f"| HF generate, static cache + torch.compile | not run | {y.hf_static_note} |"
    bound = (
        f"| decode bound | {_f(y.bound_tokens_per_s, 1)} tok/s: the engine at "
        f"{e.decoded_tokens_per_s / y.bound_tokens_per_s:.1%} | weights {y.weight_bytes / 1e6:,.1f} MB + "
        f"{e.max_batch} rows × {y.mean_context:.0f} tokens × {y.kv_bytes_per_token:,} B of KV per step, at the "
        f"measured copy bandwidth {y.copy_gb_per_s:.1f} GB/s |"
    )
    return [hf, static, bound]


def render_stages(s: Stages) -> list[str]:
    e, v, learner, sync = s.engine, s.verifier, s.learner, s.sync
    stages = ", ".join(f"{k} {n}" for k, n in sorted(v.stages.items()))
    return [
        "### Each stage alone",
        "",
        "| stage | capacity | how |",
        "| --- | --- | --- |",
        f"| engine | {_f(e.decoded_tokens_per_s, 1)} decoded tok/s | {e.requests} requests at once, max_batch "
        f"{e.max_batch}, {e.torch_threads} torch thread(s); "
        + (
            f"{_f(e.full_batch_tokens_per_s, 1)} tok/s over the {e.full_batch_s:.1f} s with max_batch rows decoding, "
            if e.full_batch_tokens_per_s
            else "the batch never seen full: the overall rate; "
        )
        + f"overall {_f(e.overall_tokens_per_s, 1)} tok/s ({e.decoded_tokens:,} tokens in {e.seconds:.1f} s, "
        f"mean {e.mean_response_tokens:.0f} per response) |",
        *_yardsticks(e),
        f"| verifier | {_f(v.verifications_per_min, 1)} verifications/min ({_f(v.per_actor_per_min, 1)} per actor) | "
        f"{v.requests} attempts at once to {v.actors} actor(s) × {v.max_concurrent_requests} in flight; "
        + (
            f"every slot busy: {v.actors * v.max_concurrent_requests} slots ÷ {v.slot_s_mean:.2f} s mean per verification, "
            if v.requests > v.actors * v.max_concurrent_requests and v.slot_s_mean > 0
            else "fewer requests than slots: the overall rate; "
        )
        + f"overall {_f(v.overall_per_min, 1)}/min ({v.seconds:.1f} s, the drain included); {v.forced_share:.0%} "
        f"forced, {v.compiled_share:.0%} real compiles, modelled latency {v.modelled_s_mean:.2f} s mean; "
        f"stages: {stages} |",
        (
            f"| learner | {_f(learner.step_s_median, 2)} s/step | median of {len(learner.step_s)}; {learner.sequences} "
            f"sequences, {learner.tokens:,} tokens, {learner.gradient_tokens:,} with gradient, "
            f"{learner.torch_threads} torch thread(s) |"
        ),
        (
            f"| weight sync | {_f(sync.publish_s_median, 3)} s publish, {_f(sync.confirmed_s_median, 3)} s to confirmed "
            f"| {sync.transport}, {sync.bytes / 1e6:.1f} MB, median of {sync.pushes} |"
        ),
    ]


def render_loops(report: BenchReport) -> list[str]:
    loops = report.loops
    head = ["| | " + " | ".join(f"η = {loop.eta}" for loop in loops) + " |", "| --- |" + " --- |" * len(loops)]
    rows: list[tuple[str, list[str]]] = [
        (
            "learner steps in the window / window s",
            [f"{loop.window_steps} / {loop.window_s:.1f}" + ("" if loop.finished else " (stopped)") for loop in loops],
        ),
        ("samples/s (trained)", [_f(loop.samples_per_s, 3) for loop in loops]),
        ("decoded tok/s", [_f(loop.decoded_tokens_per_s, 1) for loop in loops]),
        ("trained tok/s", [_f(loop.trained_tokens_per_s, 1) for loop in loops]),
        ("gradient tok/s", [_f(loop.gradient_tokens_per_s, 1) for loop in loops]),
        ("verifications/min", [_f(sum(loop.verifications_per_min.values()), 1) for loop in loops]),
        (
            "real compiles (share of verifications)",
            ["-" if loop.compiled_share is None else f"{loop.compiled_share:.0%}" for loop in loops],
        ),
        (
            "verification s p50 / p90 (n)",
            [
                f"{loop.verify_s['p50']:.2f} / {loop.verify_s['p90']:.2f} ({int(loop.verify_s['n'])})"
                if loop.verify_s.get("n")
                else "-"
                for loop in loops
            ],
        ),
    ]
    actors = sorted({a for loop in loops for a in loop.busy})
    for actor in actors:
        rows.append((f"busy {actor} ({'/'.join(_activities(loops, actor))})", [_busy(loop, actor) for loop in loops]))
    occupants = sorted({a for occ in report.occupancy.values() for a in occ})
    for actor in occupants:
        rows.append(
            (f"occupancy {actor}", [_f(report.occupancy.get(f"eta={loop.eta}", {}).get(actor)) for loop in loops])
        )
    for engine in sorted({e for loop in loops for e in loop.rows_per_step}):
        rows.append(
            (f"rows per decode step {engine} (of max_batch)", [_f(loop.rows_per_step.get(engine), 1) for loop in loops])
        )
        rows.append(
            (
                f"rows per decode step {engine} while requests waited in its queue",
                [_f(loop.rows_per_queued_step.get(engine), 1) for loop in loops],
            )
        )
    for engine in sorted({e for loop in loops for e in loop.prefill_per_decoded}):
        rows.append(
            (
                f"prefill tokens per decoded token {engine}",
                [_f(loop.prefill_per_decoded.get(engine), 2) for loop in loops],
            )
        )
        rows.append(
            (
                f"rows sharing each prefilled token {engine}",
                [_f(loop.placed_per_prefilled.get(engine), 2) for loop in loops],
            )
        )
    cpu_names = sorted({k for loop in loops for k in (loop.cpu_share or {})}, key=lambda k: (k == "machine", k))
    for name in cpu_names:
        label = "CPU share, whole machine (all users)" if name == "machine" else f"CPU share {name}"
        rows.append((label, [_f((loop.cpu_share or {}).get(name)) for loop in loops]))
    rows += [
        ("learner step s (median)", [_f(loop.learner_step_s_median) for loop in loops]),
        (
            "weight sync s p50 / p99 (n)",
            [f"{loop.sync_s['p50']:.3f} / {loop.sync_s['p99']:.3f} ({int(loop.sync_s['n'])})" for loop in loops],
        ),
        (
            "staleness: trained samples by lag",
            [", ".join(f"{lag}: {n}" for lag, n in loop.staleness.items()) or "-" for loop in loops],
        ),
        ("fraction of the ideal-overlap bound", [_f(report.bound_fraction.get(f"eta={loop.eta}")) for loop in loops]),
        ("speedup over η = 0", [_f(report.speedup.get(f"eta={loop.eta}")) for loop in loops]),
        (
            "killed / kill -> next step s",
            [f"{loop.killed} / {_f(loop.recovery_s, 1)}" if loop.killed else "-" for loop in loops],
        ),
        ("restarts", [", ".join(loop.restarts) or "-" for loop in loops]),
        ("versions only grow", [str(loop.versions_monotonic) for loop in loops]),
        ("episodes emitted = trained + filtered + pending", [_ledger(loop.episodes) for loop in loops]),
        ("no-loss id check (independent witnesses)", [_id_check(loop.id_check) for loop in loops]),
    ]
    out = ["### The loop", "", *head, *(f"| {name} | " + " | ".join(values) + " |" for name, values in rows)]
    if report.async_sync_speedup is not None:
        out += ["", f"async/sync speedup (best async run over η = 0): {report.async_sync_speedup:.2f}×"]
    return out


def _activities(loops: list[LoopResult], actor: str) -> list[str]:
    return sorted({a for loop in loops for a in loop.activities.get(actor, {})})


def _busy(loop: LoopResult, actor: str) -> str:
    if actor not in loop.busy:
        return "-"
    parts = loop.activities.get(actor, {})
    detail = ", ".join(f"{a} {v:.2f}" for a, v in sorted(parts.items())) if len(parts) > 1 else ""
    return f"{loop.busy[actor]:.2f}" + (f" ({detail})" if detail else "")


def _id_check(check: dict) -> str:
    if not check:
        return "not run"
    head = f"{check['acked']} acknowledged, {check['trained']} trained, {check['filtered']} filtered, {check['pending']} pending"
    return f"holds: {head}" if check["ok"] else f"FAILS ({', '.join(check['problems'])}): {head}"


def _ledger(ep: dict) -> str:
    return (
        f"{ep['emitted']} = {ep['trained']} + {ep['filtered_total']} + {ep['pending']} "
        f"({'holds' if ep['invariant_ok'] else 'BROKEN'})"
    )


def render_bound(bound: Bound) -> list[str]:
    out = [
        "### Ideal-overlap bound",
        "",
        "| stage | capacity alone | demand per trained sample | samples/s |",
        "| --- | --- | --- | --- |",
    ]
    for row in bound.stages:
        out.append(
            f"| {row.stage} | {_f(row.capacity, 2)} {row.unit} | {_f(row.demand, 2)} | {_f(row.samples_per_s, 3)} |"
        )
    out += ["", f"bound: {_f(bound.samples_per_s, 3)} samples/s (slowest stage: {bound.bottleneck})"]
    return out
