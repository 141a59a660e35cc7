"""`kiln bench` and what it measures with: the actors' timeline spans, the benchmark's workload knobs
(sampled lengths, unique forced candidates, the modelled verifier latency), CPU accounting, the
ideal-overlap bound, and one small bench end to end (the CI bench: a sleep-based verifier latency,
fixed lengths, every actor real and in-process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import protocols as P
from actors.verifier.health import LATENCY_BUCKETS, bucket_seconds, latency_bucket, latency_quantile
from configs import ConfigError, ModelledLatencyConfig, load_config
from launch.observe.timeline import SpanRow, activity_shares, busy_shares, covered_s, union
from protocols.timeline import SpanRecorder

ROOT = Path(__file__).resolve().parents[3]
TEXT_MATCH = ROOT / "configs" / "examples" / "text_match.yaml"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------------------ spans


def test_overlapping_units_of_one_activity_make_one_span_and_busy_counts_any_activity():
    clock = Clock()
    rec = SpanRecorder("verifier-0", None, clock=clock)
    rec._channel = object()  # keep spans as if a driver listened (take() reads them; nothing is sent)
    rec.begin("verifying")  # t=100
    clock.now = 101
    rec.begin("verifying")  # a second one overlaps
    clock.now = 103
    rec.end("verifying")
    clock.now = 104
    rec.end("verifying")  # the stretch 100..104 is one span of two units
    clock.now = 110
    rec.begin("syncing")
    clock.now = 111
    assert rec.busy_s() == pytest.approx(5.0)  # 4 s verifying + 1 s of syncing still open
    spans = rec.take()  # the open one is cut at now and goes on from there
    assert [(s.activity, s.start, s.end, s.units) for s in spans] == [
        ("verifying", 100, 104, 2),
        ("syncing", 110, 111, 1),
    ]
    clock.now = 112
    rec.end("syncing")
    assert [(s.activity, s.start, s.end, s.units) for s in rec.take()] == [("syncing", 111, 112, 0)]
    rec.record("training", 120.0, 122.5)
    assert rec.busy_s() == pytest.approx(8.5)
    assert [(s.activity, s.start, s.end) for s in rec.take()] == [("training", 120.0, 122.5)]


def test_a_recorder_pushes_its_spans_to_the_driver_and_the_span_record_is_checked():
    from protocols.channels import PullChannel

    pull = PullChannel()
    rec = SpanRecorder("rollout-0", pull.address, flush_s=0.05)
    try:
        with rec.span("generating"):
            time.sleep(0.12)  # a flush falls inside: the open span arrives in pieces
        got = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sum(s.end - s.start for s in got) < 0.11:
            msg = pull.recv(timeout_s=0.5)
            if isinstance(msg, P.Timeline):
                assert msg.actor_id == "rollout-0"
                got += msg.spans
        assert {s.activity for s in got} == {"generating"} and len(got) >= 2
        assert covered_s([SpanRow("r", s.activity, s.start, s.end) for s in got], 0, 1e12) == pytest.approx(
            rec.busy_s(), abs=0.02
        )
    finally:
        rec.close()
        pull.close()
    with pytest.raises(P.ProtocolError, match="before it starts"):
        P.encode(P.Timeline(actor_id="x", spans=[P.Span(activity="training", start=2.0, end=1.0)]))
    with pytest.raises(P.ProtocolError, match="expected one of"):
        P.encode(P.Timeline(actor_id="x", spans=[P.Span(activity="napping", start=1.0, end=2.0)]))


def test_timeline_shares_work_on_the_union_of_spans_inside_the_window():
    spans = [
        SpanRow("learner", "training", 0, 4),
        SpanRow("learner", "syncing", 3, 5),
        SpanRow("rollout-0", "generating", 2, 6),
        SpanRow("rollout-0", "generating", 5, 12),
    ]
    assert union([(3, 5), (0, 4), (7, 8)]) == [(0, 5), (7, 8)]
    assert covered_s(spans[2:], 4, 10) == pytest.approx(6.0)
    assert busy_shares(spans, 2, 12) == {"learner": pytest.approx(0.3), "rollout-0": pytest.approx(1.0)}
    assert activity_shares(spans, 2, 12) == {
        "learner": {"syncing": pytest.approx(0.2), "training": pytest.approx(0.2)},
        "rollout-0": {"generating": pytest.approx(1.0)},
    }


# ---------------------------------------------------------------------------- workload knobs


def test_sampled_lengths_are_drawn_per_request_and_forced_responses_pass_unchanged(one_torch_thread):
    from actors.rollout.engine import GenerateRequest, SamplingParams
    from actors.rollout.engines import make_engine
    from actors.rollout.workload import SampledLengthEngine

    cfg = load_config(
        TEXT_MATCH, ["rollout.bench.lengths=[7,3]", "rollout.bench.length_weights=[1,3]", "rollout.max_new_tokens=5"]
    )
    engine = make_engine(cfg.rollout, cfg.model, index=0, eos_token_ids=[257])
    try:
        assert isinstance(engine, SampledLengthEngine)
        params = SamplingParams(max_new_tokens=5, stop_token_ids=(257,))  # the end of turn is ignored too
        gens = engine.generate([GenerateRequest(f"r{i}", [256, 65, 66], params) for i in range(40)])
        lengths = [len(g.output_ids) for g in gens]
        assert set(lengths) == {3, 7} and 20 <= lengths.count(3) <= 38  # eos ignored: exactly as drawn
        (forced,) = engine.generate([GenerateRequest("f", [256, 65], params, forced_response=[70, 71])])
        assert forced.output_ids.tolist() == [70, 71]
        assert engine.health().tokens == sum(lengths)  # the scored tokens are not decoded ones
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="one weight >= 0 per entry"):
        load_config(TEXT_MATCH, ["rollout.bench.lengths=[7,3]", "rollout.bench.length_weights=[1]"])
    with pytest.raises(ConfigError, match="must be >= 1"):
        load_config(TEXT_MATCH, ["rollout.bench.lengths=[0]"])


def test_the_engine_alone_is_timed_while_its_batch_is_full_and_the_long_tail_drain_is_left_out(one_torch_thread):
    from actors.rollout.engines import make_engine
    from launch.bench.stages import Workload, measure_engine

    cfg = load_config(
        TEXT_MATCH, ["rollout.max_batch=4", "rollout.bench.lengths=[8,160]", "rollout.bench.length_weights=[3,1]"]
    )
    work = Workload.of(cfg)
    engine = make_engine(cfg.rollout, cfg.model, index=0, eos_token_ids=list(work.tokenizer.stop_ids))
    try:
        stage = measure_engine(engine, work, requests=24, poll_s=0.01)
        assert stage.decoded_tokens == sum(len(g.output_ids) for _, _, g in work.sampled)
        assert {len(g.output_ids) for _, _, g in work.sampled} == {8, 160}
        # The batch was seen full while requests waited: that stretch's rate is the capacity.
        assert stage.full_batch_tokens_per_s is not None and stage.full_batch_s > 0
        assert stage.decoded_tokens_per_s == stage.full_batch_tokens_per_s
        assert stage.overall_tokens_per_s == pytest.approx(stage.decoded_tokens / stage.seconds)
        alone = measure_engine(engine, work, requests=4, poll_s=0.01)  # never more than max_batch: no queue
        assert alone.full_batch_tokens_per_s is None and alone.decoded_tokens_per_s == alone.overall_tokens_per_s
    finally:
        engine.close()


def test_unique_forced_candidates_differ_in_their_cpp_source_only():
    from actors.buffer.task_source import load_task_set
    from actors.rollout.forced import _CPP_BLOCK, CandidatePool

    cfg = load_config(ROOT / "configs" / "default.yaml", [])
    task = next(t for t in load_task_set(cfg.replay, "cpu").train if t.kernel.name.endswith("relu"))
    plain = CandidatePool(ROOT / "tasks" / "solutions" / "cpu", seed=3)
    unique = CandidatePool(ROOT / "tasks" / "solutions" / "cpu", seed=3, unique=True)
    for _ in range(20):
        a, b = plain.draw(task), unique.draw(task)
        block = _CPP_BLOCK.search(a)
        if block is None:  # the fallback and the cut-off candidates carry no C++ source
            assert a == b
            continue
        assert a != b and "// kiln bench " in _CPP_BLOCK.search(b).group(3)
        assert b.replace(_CPP_BLOCK.search(b).group(3), block.group(3)) == a


def test_the_modelled_latency_is_long_tailed_capped_and_off_by_default():
    from actors.verifier.latency import ModelledLatency

    assert ModelledLatency(ModelledLatencyConfig()).draw() == 0.0
    latency = ModelledLatency(ModelledLatencyConfig(median_s=1.0, sigma=1.0, max_s=8.0))
    draws = sorted(latency.draw() for _ in range(4000))
    assert draws[2000] == pytest.approx(1.0, rel=0.1)  # the median
    assert draws[3600] == pytest.approx(3.6, rel=0.15)  # p90 = e^1.28
    assert max(draws) == 8.0  # capped
    assert ModelledLatency(ModelledLatencyConfig(median_s=0.5, sigma=0.0)).draw() == 0.5


def test_the_verifier_actor_sleeps_the_modelled_latency_inside_its_verifying_span():
    from actors.buffer.examples import TextMatchTasks
    from actors.verifier.actor import VerifierActor

    cfg = load_config(TEXT_MATCH, ["verifier.modelled_latency.median_s=0.2", "verifier.modelled_latency.sigma=0"])
    actor = VerifierActor(cfg.verifier)
    actor.start()
    try:
        task = TextMatchTasks(cfg.replay, "cpu").tasks()[0]
        started = time.monotonic()
        result = actor.verify(P.VerifyRequest(request_id="r1", task=task, candidate="abc"))
        assert time.monotonic() - started >= 0.2 and result.error_class == "correctness"
        health = actor.health()
        assert health.modelled_s == pytest.approx(0.2) and health.busy_s >= 0.2 and health.compiled == 0
        # the latency histogram holds the one verification, in the bucket of its 0.2 s and more
        assert sum(health.latency_counts) == 1
        assert 0.2 <= latency_quantile(health.latency_counts, 0.5) < 0.3
    finally:
        actor.stop()


def test_the_latency_histogram_subtracts_into_a_window_and_its_quantiles_are_within_a_bucket():
    counts_before = [0] * LATENCY_BUCKETS
    counts_after = list(counts_before)
    for seconds in (0.5, 100.0, 100.0):
        counts_before[latency_bucket(seconds)] += 1
        counts_after[latency_bucket(seconds)] += 1
    window = [1.0, 2.0, 3.0, 4.0, 40.0, 1e-4, 9e9]  # two outside the range land in its end buckets
    for seconds in window:
        counts_after[latency_bucket(seconds)] += 1
    delta = [b - a for a, b in zip(counts_before, counts_after, strict=True)]
    assert sum(delta) == len(window)
    assert latency_quantile(delta, 0.5) == pytest.approx(3.0, rel=0.045)
    assert latency_quantile(delta, 0.8) == pytest.approx(40.0, rel=0.045)
    assert latency_quantile(delta, 0.0) == bucket_seconds(0) and latency_quantile(delta, 1.0) == 2.0**12
    assert latency_quantile([0] * LATENCY_BUCKETS, 0.5) is None
    for seconds in (0.01, 0.37, 1.0, 2.5, 61.0, 3000.0):  # each bucket's middle within 4.5% of its latencies
        assert bucket_seconds(latency_bucket(seconds)) == pytest.approx(seconds, rel=0.045)


# ------------------------------------------------------------------------------------ CPU time


def test_process_tree_cpu_time_counts_live_and_reaped_children_and_alone_leaves_them_out():
    from launch.bench import cpu

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    me = {"me": os.getpid()}
    before = cpu.tree_cpu_s(me)["me"]
    subprocess.run([sys.executable, "-c", burn], check=True)  # runs, exits, is reaped by us
    assert cpu.tree_cpu_s(me)["me"] - before >= 0.35
    child = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)\n"])
    try:
        time.sleep(0.1)
        deadline = time.monotonic() + 20
        while cpu.tree_cpu_s({"c": child.pid})["c"] < 0.35 and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = cpu.tree_cpu_s(me)["me"]
        alone = cpu.tree_cpu_s(me, alone=frozenset({"me"}))["me"]
        assert tree - alone >= 0.3  # the live child's time is in the tree, not in the process alone
    finally:
        child.kill()
        child.wait()
    assert cpu.machine_busy_s() > 0


# --------------------------------------------------------------------------------- the bound


def test_the_ideal_overlap_bound_is_the_slowest_stage_in_samples_per_second():
    from launch.bench.report import ideal_bound, occupancy
    from launch.bench.stages import EngineStage, LearnerStage, Stages, SyncStage, VerifierStage
    from launch.bench.train import LoopResult

    stages = Stages(
        engine=EngineStage(100.0, 32, 3200, 32.0, 16, 1, 100.0),
        verifier=VerifierStage(120.0, 120.0, 64, 32.0, 1, 16, 0.5, 0.3, 2.0),
        learner=LearnerStage(3.5, [3.5], 16, 40000, 9000),
        sync=SyncStage("gloo", 10, 0.5, 0.6, 3),
    )
    loop = LoopResult(
        eta=1,
        run_dir="",
        steps=6,
        window_steps=4,
        window=(0.0, 100.0),
        step_times=[],
        window_s=100.0,
        wall_s=200.0,
        samples_per_s=0.64,
        decoded_tokens_per_s=80.0,
        trained_tokens_per_s=0.0,
        gradient_tokens_per_s=0.0,
        trained_samples=64,
        decoded_tokens=8000.0,
        decoded_per_engine={"rollout-0": 80.0},
        counters_s=100.0,
        verifications=128.0,
        verifications_per_min={"verifier-0": 76.8},
        compiled_share=0.3,
        verify_s={},
        learner_step_s_median=3.5,
        sync_s={},
        busy={},
        activities={},
        cpu_share=None,
        cores=2,
        staleness={},
        restarts=[],
        versions_monotonic=True,
        episodes={},
        id_check={},
        killed=None,
        recovery_s=None,
        finished=True,
    )
    bound = ideal_bound(stages, [loop], engines=1, batch_sequences=16)
    # engine: 100 tok/s ÷ 125 decoded tokens per trained sample = 0.8; verifier: 2/s ÷ 2 = 1.0;
    # learner: 16 ÷ (3.5 + 0.5) = 4.0
    assert [round(s.samples_per_s, 6) for s in bound.stages] == [0.8, 1.0, 4.0]
    assert bound.bottleneck == "engines" and bound.samples_per_s == pytest.approx(0.8)
    assert occupancy(loop, stages) == {"rollout-0": pytest.approx(0.8), "verifier-0": pytest.approx(0.64)}


# --------------------------------------------------------------------------------------- CLI


def test_bench_refuses_bad_arguments_in_one_line(capsys):
    from launch.cli.main import main

    assert main(["bench", str(TEXT_MATCH), "--kill", "nobody@2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such actor" in err and "rollout-0" in err
    assert main(["bench", str(TEXT_MATCH), "--eta", "0"]) == 2
    assert "η >= 1" in capsys.readouterr().err
    assert main(["bench", str(TEXT_MATCH), "--no-sync", "--no-async"]) == 2
    assert "leave no loop run" in capsys.readouterr().err
    assert main(["bench", str(TEXT_MATCH), "rollout.nope=1"]) == 2
    assert "unknown config key" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the CI bench


@pytest.mark.timeout(120)
def test_a_small_bench_reports_every_figure_and_async_beats_sync(tmp_path, capsys):
    """The stages alone, then the loop at η = 0 and η = 1 (every actor in-process), on a workload
    where verification is a long-tailed sleep (median 0.3 s) and every response 16 tokens: the
    lock-step groups of η = 0 wait for their slowest verification and for the learner, η = 1 overlaps
    them. Every step trains the first two groups made for it (no tied-group filter, no repair tasks):
    with the filter on, the groups a step waited for varied with how many tied, and six runs gave
    async/sync 1.46-4.83 (one CI run 1.23); without it, 1.95-2.29 (docs/BENCHMARKS.md)."""
    from launch.cli.main import main

    out = tmp_path / "bench"
    assert (
        main(
            [
                "bench",
                str(TEXT_MATCH),
                "cluster.use_ray=false",
                "rollout.bench.lengths=[16]",
                "verifier.modelled_latency.median_s=0.3",
                "verifier.modelled_latency.sigma=1.0",
                "verifier.modelled_latency.max_s=3",
                "algo.group_size=4",
                "algo.batch_groups=2",
                "rollout.max_attempts_at_engine=16",
                "verifier.max_concurrent_requests=32",
                "rollout.torch_threads=1",
                "learner.torch_threads=1",
                "logging.level=WARNING",
                "algo.drop_tied_groups=false",
                "replay.retry.probability=0",
                "--eta",
                "1",
                "--warmup",
                "1",
                "--steps",
                "4",
                "--engine-requests",
                "64",
                "--verifier-requests",
                "64",
                "--learner-steps",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    for line in (
        "### Each stage alone",
        "| engine |",
        "| verifier |",
        "| learner |",
        "| weight sync |",
        "### The loop",
        "| samples/s (trained) |",
        "| decoded tok/s |",
        "| trained tok/s |",
        "| gradient tok/s |",
        "| occupancy rollout-0 |",
        "| occupancy verifier-0 |",
        "CPU share",
        "| weight sync s p50 / p99 (n) |",
        "| rows per decode step rollout-0 (of max_batch) |",
        "| staleness: trained samples by lag |",
        "| fraction of the ideal-overlap bound |",
        "async/sync speedup",
        "### Ideal-overlap bound",
    ):
        assert line in table, line
    report = json.loads((out / "bench.json").read_text())
    assert {
        "config",
        "command",
        "date",
        "device",
        "load_average",
        "stages",
        "loops",
        "occupancy",
        "bound",
        "bound_fraction",
        "speedup",
        "async_sync_speedup",
        "gantt",
    } <= set(report)
    assert set(report["stages"]) == {"engine", "verifier", "learner", "sync"}
    assert report["stages"]["engine"]["decoded_tokens"] == 64 * 16
    assert report["stages"]["learner"]["gradient_tokens"] > 0
    verifier = report["stages"]["verifier"]  # 64 requests on 32 slots: the capacity is the slots' rate
    assert verifier["verifications_per_min"] == pytest.approx(60.0 * 32 / verifier["slot_s_mean"])
    assert verifier["overall_per_min"] == pytest.approx(60.0 * 64 / verifier["seconds"])
    sync, async_ = report["loops"]
    assert (sync["eta"], async_["eta"]) == (0, 1) and sync["window_steps"] == async_["window_steps"] == 4
    for loop in report["loops"]:
        assert loop["samples_per_s"] > 0 and loop["decoded_tokens_per_s"] > 0 and loop["episodes"]["invariant_ok"]
        assert {"learner", "rollout-0", "verifier-0"} <= set(loop["busy"])
        assert {"training", "syncing"} <= set(loop["activities"]["learner"])
        assert "generating" in loop["activities"]["rollout-0"] and "verifying" in loop["activities"]["verifier-0"]
        assert loop["sync_s"]["n"] == 4 and loop["cpu_share"] is not None
        assert 1.0 <= loop["rows_per_step"]["rollout-0"] <= 64  # text_match.yaml's rollout.max_batch
        # 16 attempts in flight never fill 64 slots: every request is admitted in the cycle it is seen,
        # so no decode step counts as one taken while requests waited in the engine's queue.
        assert loop["rows_per_queued_step"] == {}
    assert set(sync["staleness"]) == {"0"}  # η = 0 never trains on an older version
    assert report["bound"]["samples_per_s"] > 0 and set(report["bound_fraction"]) == {"eta=0", "eta=1"}
    assert report["async_sync_speedup"] == report["speedup"]["eta=1"] >= 1.3
    gantt = Path(report["gantt"])
    assert gantt == out / "gantt.png" and gantt.stat().st_size > 20_000
    assert (out / "eta0" / "timeline.jsonl").is_file() and (out / "report.md").read_text().startswith("## kiln bench")
