"""`kiln train` end to end on CPU: every actor real (torch engine, the example reward actor, replay,
torch learner, gloo weight sync), in-process and as Ray actors, with faults injected mid-run.

The example reward actor keeps these runs to seconds per step; the kernel verifier's path through
the same driver is `make demo` (README) and tests/launch/driver/test_demo.py.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from configs import load_config
from launch.driver.run_dir import RunDirectory
from launch.driver.train import rollout_only, train, train_only
from launch.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[3]
TEXT_MATCH = ROOT / "configs" / "examples" / "text_match.yaml"


def text_match(tmp_path: Path, name: str, *overrides: str):
    cfg = load_config(
        TEXT_MATCH, [f"logging.root={tmp_path}", f"logging.run_name={name}", "logging.live=false", *overrides]
    )
    return cfg, RunDirectory.create(cfg)


def versions(run: RunDirectory) -> list[int]:
    return [int(r["weights/version"]) for r in read_metrics(run.path) if r.get("weights/version") is not None]


def test_a_run_in_process_trains_pushes_weights_and_reports(tmp_path, caplog):
    cfg, run = text_match(
        tmp_path, "inproc", "cluster.use_ray=false", "algo.total_steps=5", "learner.checkpoint_every=2"
    )
    with caplog.at_level(logging.INFO, logger="actors.learner.weight_sync"):
        report = train(cfg, run)
    assert versions(run) == [1, 2, 3, 4, 5]
    # the run's end stops the rollout actor in order: the learner forgets its engine without a warning
    drops = [r for r in caplog.records if "dropping engine rollout-0" in r.getMessage()]
    assert [(r.levelno, r.getMessage().split(": ")[-1]) for r in drops] == [(logging.INFO, "the run stopped its actor")]
    summary = json.loads((run.path / "summary.json").read_text())
    ep = summary["episodes"]
    assert ep["invariant_ok"] and ep["emitted"] == ep["trained"] + ep["filtered_total"] + ep["pending"]
    assert summary["id_check"]["ok"], summary["id_check"]  # independent witnesses agree (id_check.py)
    assert ep["trained"] >= 5 * cfg.algo.batch_groups * cfg.algo.group_size
    text = report.read_text()
    assert "Validation" in text and (run.path / "plots" / "reward.png").stat().st_size > 1000
    assert list((run.path / "episodes").glob("step-*.txt"))
    rows = read_metrics(run.path)
    assert any("eval/pass@1" in r for r in rows) and any("reward/mean" in r for r in rows)
    assert all(r["replay/invariant_ok"] == 1.0 for r in rows if "replay/invariant_ok" in r)
    # the final model is an HF checkpoint that transformers loads, equal to the last checkpoint's weights
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run.final_model, local_files_only=True)
    assert model.config.hidden_size == cfg.model.hidden_size


def test_killing_a_rollout_of_two_and_the_learner_mid_run_loses_nothing_and_keeps_the_pace(tmp_path, ray_session):
    # Two rollout actors: while the dead one's standby takes over, the other keeps the learner fed (the
    # dead one's groups are released at once, not timed out). Each has a warm standby (rollout.standby,
    # learner.standby): a spare process, prepared ahead, takes over (the learner's restores the
    # checkpoint of the last step).
    # η = 0, no tied-group filter and no repair tasks: every step takes one batch of fresh samples of
    # the same short prompts, so the step intervals are regular; 16 groups a step, so a step is long
    # enough (about half a second here) that its pace is not the noise of a 2-core machine. Each kill
    # waits for the standbys to be prepared (at the start, and again after each takeover): 50 steps.
    cfg, run = text_match(
        tmp_path,
        "faults",
        "cluster.use_ray=true",
        "algo.total_steps=50",
        "rollout.num_actors=2",
        "learner.checkpoint_every=1",
        "algo.max_staleness=0",
        "algo.drop_tied_groups=false",
        "replay.retry.probability=0",
        "algo.batch_groups=16",
    )
    inject, times, killed, infra = kill_and_time({4: "rollout-0", 7: "learner"}, ["rollout-0", "rollout-1"])
    train(cfg, run, on_step=inject)
    summary = json.loads((run.path / "summary.json").read_text())
    assert {r["actor"] for r in summary["restarts"]} >= {"rollout-0", "learner"}
    assert all(r["standby"] for r in summary["restarts"]), summary["restarts"]  # each taken over by its spare
    assert set(killed) == {"rollout-0", "learner"}
    seen = versions(run)
    assert seen == sorted(set(seen)), f"weight versions must only grow: {seen}"
    assert summary["learner"]["version"] >= cfg.algo.total_steps, (seen, summary["learner"])
    assert summary["learner"]["restored_from"] >= 0  # the new learner came from a checkpoint
    ep = summary["episodes"]
    assert ep["invariant_ok"] and ep["emitted"] == ep["trained"] + ep["filtered_total"] + ep["pending"]
    assert summary["id_check"]["ok"], summary["id_check"]  # independent witnesses agree (id_check.py)
    assert infra and max(infra) == 0  # no attempt was marked infra by a verify timeout
    # Each Ray actor logs into RUN_DIR/logs/NAME.log; a standby appends to the file of the one it replaced.
    assert (run.path / "logs" / "learner.log").read_text().count("serving version") == 2
    assert (run.path / "logs" / "rollout-1.log").read_text().count("joined the learner's weights") >= 2
    # The driver sees each death at once (the actor's pending vigil call fails): the dead rollout's
    # groups go back to replay at that moment (replay logs each as expired; at group_timeout_s = 3600 s
    # none would expire in this run without the release), and its share to the survivor. (Without
    # `Session._release_groups` the dead one's groups hold the admission window: the run stalls.)
    released = expiries(run.path / "logs" / "replay.log")
    assert released and all(0 <= t - killed["rollout-0"] < 10 for t in released), (released, killed)
    # A standby takes over (asserted above): the learner's restores the checkpoint of the step the
    # driver saw, and the engines rejoin it without holding its first step (their groups form outside
    # the weight lock). Until the standby joins, one rollout actor generates for two. Alone on this
    # 2-core machine the step after each kill read 1.05-1.32 median intervals (sessions 22-32); in CI,
    # beside the other xdist worker's tests and the replacement standby being prepared, 1.67, 2.38 and
    # 3.47. The bound is there to catch a stall: a cold restart (4-12 s) reads 8-24 intervals, and an
    # engine that held the new learner's first step until its join timed out (30 s), more. The takeover's own
    # pace is a benchmark figure (`kiln bench --kill`, docs/BENCHMARKS.md), and the in-process test
    # below, with fewer processes to share two cores, holds it to 1.5.
    assert_next_step_on_time(times, killed, limit=4.0)


def expiries(replay_log: Path) -> list[float]:
    """When replay expired a group (its log's local-time stamps, as epoch seconds)."""
    stamps = [line[:23] for line in replay_log.read_text().splitlines() if "expired with" in line]
    return [datetime.strptime(s, "%Y-%m-%d %H:%M:%S.%f").timestamp() for s in stamps]


def test_a_two_rank_learner_trains_and_restarts_as_a_group_when_a_rank_dies(tmp_path, ray_session):
    cfg, run = text_match(
        tmp_path,
        "ranks",
        "cluster.use_ray=true",
        "learner.cpu_ranks=2",
        "algo.total_steps=8",
        "learner.checkpoint_every=2",
    )
    killed: list[int] = []

    def inject(session, step: int) -> None:
        if step == 3 and not killed:
            killed.append(step)
            session.supervisor["learner-1"].kill()  # a follower: the leader is stuck in its collectives

    train(cfg, run, on_step=inject)
    assert killed == [3]
    summary = json.loads((run.path / "summary.json").read_text())
    assert {r["actor"] for r in summary["restarts"]} == {"learner", "learner-1"}  # the group, nothing else
    seen = versions(run)
    assert seen == sorted(set(seen)) and seen[-1] >= cfg.algo.total_steps
    assert summary["learner"]["restored_from"] >= 2
    ep = summary["episodes"]
    assert ep["invariant_ok"] and ep["emitted"] == ep["trained"] + ep["filtered_total"] + ep["pending"]
    assert summary["id_check"]["ok"], summary["id_check"]  # independent witnesses agree (id_check.py)
    assert (run.final_model / "config.json").exists()
    # rank 1 did its share of the steps (the driver reads its busy time like any actor's)
    rows = read_metrics(run.path)
    assert any(r.get("busy/learner-1", 0) > 0 for r in rows)


def test_resume_continues_a_run_above_its_versions(tmp_path):
    cfg, run = text_match(
        tmp_path, "resume", "cluster.use_ray=false", "algo.total_steps=3", "learner.checkpoint_every=1"
    )
    train(cfg, run)
    first = versions(run)
    assert first == [1, 2, 3]
    more = load_config(run.config_path, ["algo.total_steps=6"])  # what `kiln train --resume` loads
    train(more, RunDirectory.open(run.path))  # the learner finds the versions its run announced
    seen = versions(run)
    assert seen[:3] == first and seen == sorted(set(seen)) and seen[-1] >= 6, seen
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["learner"]["restored_from"] == 3 and summary["episodes"]["invariant_ok"]


def test_rollout_only_then_train_only(tmp_path):
    # 12 groups of the initial model; a batch needs 2 groups whose rewards are not all tied
    cfg, run = text_match(tmp_path, "rollout", "cluster.use_ray=false", "algo.total_steps=6", "algo.batch_groups=2")
    episodes = rollout_only(cfg, run)
    assert sum(f.stat().st_size for f in episodes.glob("*.kiln")) > 0
    cfg2, run2 = text_match(tmp_path, "train", "cluster.use_ray=false", "algo.total_steps=3", "algo.batch_groups=2")
    report = train_only(cfg2, run2, episodes)
    assert versions(run2) == [1, 2, 3] and report.is_file()


def test_dry_run_prints_the_plan_and_refuses_infeasible_ones():
    cmd = [sys.executable, "-m", "launch.cli", "train", "--dry-run"]
    ok = subprocess.run(
        cmd + ["--config", "configs/eight_gpu.yaml"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0, ok.stderr
    assert "learner" in ok.stdout and "engines" in ok.stdout
    bad = subprocess.run(
        cmd + ["--config", "configs/eight_gpu.yaml", "cluster.num_gpus=4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "infeasible placement" in bad.stderr


def bench_loop(tmp_path, *args: str) -> dict:
    """One loop run of `kiln bench` (no stages alone, no η = 0 run), in-process; its LoopResult as JSON."""
    from launch.cli.main import main

    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                str(TEXT_MATCH),
                "cluster.use_ray=false",
                "--no-stages",
                "--no-sync",
                "--eta",
                "1",
                "--out",
                str(tmp_path / "bench"),
                "--json",
                str(out),
                *args,
            ]
        )
        == 0
    )
    (loop,) = json.loads(out.read_text())["loops"]
    return loop


def test_bench_measures_a_run_and_its_recovery_from_a_kill(tmp_path):
    result = bench_loop(tmp_path, "--kill", "rollout-0@2", "--warmup", "1", "--steps", "7")
    # (enough steps after the kill for the driver's 5-second supervision tick to see the death)
    assert result["steps"] == 8 and result["restarts"] == ["rollout-0"] and result["versions_monotonic"]
    assert result["recovery_s"] is not None and result["recovery_s"] < 60  # no wait for a push timeout
    assert result["sync_s"]["max"] < 60
    assert result["samples_per_s"] > 0 and result["decoded_tokens_per_s"] > 0 and result["trained_tokens_per_s"] > 0
    assert set(result["busy"]) == {"learner", "rollout-0", "verifier-0"}
    # the window's verifications, each counted in the verifier's latency histogram (those under way
    # at a reading are counted once they end, their replies once sent)
    assert abs(result["verify_s"]["n"] - result["verifications"]) <= 64
    assert 0 < result["verify_s"]["p50"] <= result["verify_s"]["p90"]
    ep = result["episodes"]
    assert ep["invariant_ok"] and ep["emitted"] == ep["trained"] + ep["filtered_total"] + ep["pending"]
    assert result["id_check"]["ok"], result["id_check"]


def test_bench_stop_after_ends_the_run_at_a_step_and_summarises_it(tmp_path, capsys):
    result = bench_loop(tmp_path, "--stop-after", "0", "--warmup", "1", "--steps", "48")
    assert result["steps"] == 2 and not result["finished"]  # step 2 is the first with a window
    assert result["samples_per_s"] > 0 and result["episodes"]["invariant_ok"]
    assert "1 / " in capsys.readouterr().out and "(stopped)" in (tmp_path / "bench" / "report.md").read_text()


def kill_and_time(kills: dict[int, str], health_of: list[str]):
    """An `on_step` that kills `kills[step]` once the driver has seen that step, and records when the
    learner finished every step, when each kill happened, and the rollout actors' counts of attempts
    marked infra. A kill waits (to a later step) while an earlier victim's replacement is still
    starting or a standby is being prepared, and until three steps were taken after that: the pace it
    is measured against is a steady one."""
    times: dict[int, float] = {}
    killed: dict[str, float] = {}
    infra: list[int] = []
    steady_from = [0]  # the first step whose three intervals before it are all after the last restart

    def inject(session, step: int) -> None:
        times.update(session.monitor.step_times)
        step = max(times)  # rows come in batches: the pace is the newest step the driver has seen
        due = [s for s in kills if s <= step]
        if session.supervisor.restarting or session.supervisor.standbys_preparing():
            steady_from[0] = step + 4  # a spare being prepared takes CPU from the loop on 2 cores
        elif due and step >= steady_from[0]:  # at once: the kill lands right after the step, as the driver saw it
            name = kills.pop(min(due))
            killed[name] = time.time()
            session.supervisor[name].kill()
            steady_from[0] = step + 4
            print(
                f"{name} killed {killed[name] - times[step]:.3f} s after the driver saw step {step} "
                f"(at {killed[name]:.3f})"
            )
        if step % 3 == 0:  # health calls slow the driver: now and then (after a kill, the survivors')
            for handle in session.rollouts:
                if handle.name in health_of:
                    try:
                        infra.append(handle.health().verify_infra)
                    except Exception:  # noqa: BLE001, S110 - the one killed a moment ago, not restarted yet
                        pass

    return inject, times, killed, infra


def step_gap_ratio(times: dict[int, float], killed_at: float) -> float:
    """The interval that holds the kill (up to the first learner step after it) over the median of the
    three step intervals before it."""
    n = min(s for s, t in times.items() if t > killed_at)
    before = [times[s] - times[s - 1] for s in (n - 3, n - 2, n - 1)]
    return (times[n] - times[n - 1]) / statistics.median(before)


def assert_next_step_on_time(times: dict[int, float], killed: dict[str, float], limit: float = 1.5) -> None:
    """The first learner step after each kill comes within `limit` × the median of the three step
    intervals before it."""
    ratios = {name: round(step_gap_ratio(times, at), 2) for name, at in killed.items()}
    print(f"the step after each kill, in median step intervals: {ratios}")  # for the record (`pytest -s`)
    assert max(ratios.values()) <= limit, f"the step after a kill took this many median intervals: {ratios}"


def test_killing_replay_and_a_verifier_of_two_mid_run_loses_nothing_and_keeps_the_pace(tmp_path):
    # η = 0 and no tied-group filter: every step waits for one batch of fresh samples, so the step
    # intervals are regular (at η = 1 the learner takes steps in bursts from samples made ahead, and
    # with the filter on, the groups a step needs vary with how many tie: either way the median
    # interval before a kill is noise, not a pace)
    # 16 groups a step: with the filter on, the example's steps consumed ~18 generated groups (about
    # half tie), so this keeps the generation a step waits for as it was, without the filter's noise.
    # The kills come after step 6: by then the retry buffer serves repair tasks (longer prompts) and the
    # pace has settled.
    cfg, run = text_match(
        tmp_path,
        "faults2",
        "cluster.use_ray=false",
        "algo.total_steps=13",
        "algo.max_staleness=0",
        "verifier.num_actors=2",
        "algo.drop_tied_groups=false",
        "algo.batch_groups=16",
    )
    inject, times, killed, infra = kill_and_time({6: "verifier-0", 10: "replay"}, ["rollout-0"])
    train(cfg, run, on_step=inject)
    summary = json.loads((run.path / "summary.json").read_text())
    assert {r["actor"] for r in summary["restarts"]} >= {"verifier-0", "replay"}
    assert set(killed) == {"verifier-0", "replay"}
    ep = summary["episodes"]
    assert ep["invariant_ok"] and ep["emitted"] == ep["trained"] + ep["filtered_total"] + ep["pending"]
    assert summary["id_check"]["ok"], summary["id_check"]  # independent witnesses agree (id_check.py)
    assert infra and max(infra) == 0  # no attempt was marked infra by a verify timeout
    # Replay dies: it restarts from its log, and every request that waited on the dead one (or was made
    # while it was down) goes to the new one as soon as it registers. One of two verifiers dies: its
    # requests move to the other at once. Either way the pace holds.
    assert_next_step_on_time(times, killed)
