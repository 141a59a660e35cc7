"""Observability of a training run: the metrics stream, the live view, episode dumps, validation
metrics and the end-of-run report (launch/metrics.py, live.py, episode_dump.py, evaluation.py,
report.py)."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import time

import numpy as np
import pytest
from rich.console import Console

from actors.policy.tokenizer import ByteTokenizer, Message
from configs import LoggingConfig
from launch.episode_dump import dump_episodes
from actors.rollout.evaluation import eval_metrics, fast_p, pass_at_k
from launch.live import LiveView
from launch.metrics import MetricsLog, read_metrics
from launch.report import write_report
from protocols import Episode, KernelSpec, RepairContext, Task, Turn, VerifyResult

# ------------------------------------------------------------------------------------ metrics


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
    with caplog.at_level(logging.WARNING, logger="launch.metrics"):
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
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(
        log=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)  # wandb is not installed here
    cfg = LoggingConfig(tensorboard=False, wandb=True, wandb_project="kernels", wandb_entity="lab",
                        wandb_run_name="relu-sweep-3")
    MetricsLog(tmp_path, cfg).close()
    MetricsLog(tmp_path, LoggingConfig(tensorboard=False, wandb=True, run_name="r7")).close()
    assert calls == [{"project": "kernels", "entity": "lab", "name": "relu-sweep-3", "dir": str(tmp_path)},
                     {"project": "kiln", "entity": None, "name": "r7", "dir": str(tmp_path)}]


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


# ------------------------------------------------------------------------------------ live view

STEP_VALUES = {
    "weights/version": 3, "rollout/samples_per_s": 12.5, "rollout/tokens_per_s": 4321.0,
    "reward/mean": 0.375, "reward/pass_rate": 0.25, "verifier/compile": 2, "verifier/done": 1,
    "verifier/passed": 1, "verifier/error/compile": 2, "staleness/mean": 0.5, "staleness/max": 1,
    "replay/bdr_share": 0.125, "train/kept_fraction": 0.9, "busy/rollout-0": 0.5, "busy/verifier-0": 0.75,
}


def test_live_view_prints_one_plain_line_per_step_when_disabled():
    out = io.StringIO()
    with LiveView(False, total_steps=10, stream=out) as view:
        view.update(3, STEP_VALUES)
        view.update(4, {"weights/version": 4})  # other keys keep their last value
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 3/10 | weights v 3 | samples/s 12.5 | tokens/s 4,321 | reward 0.375")
    assert "pass rate 0.25" in lines[0] and "BDR share 0.125" in lines[0] and "MirrorPop kept 0.9" in lines[0]
    assert "verifier compile 2 done 1 passed 1 error/compile 2" in lines[0]
    assert "busy rollout-0 50% verifier-0 75%" in lines[0]
    assert lines[1].startswith("step 4/10 | weights v 4 | samples/s 12.5")


def test_live_view_without_a_terminal_falls_back_to_plain_lines():
    out = io.StringIO()
    with LiveView(True, total_steps=5, stream=out) as view:  # a StringIO is no terminal
        view.update(1, {"reward/mean": 0.5})
    assert out.getvalue() == "step 1/5 | reward 0.5\n"


def test_live_view_on_a_terminal_draws_the_rich_panel():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    with LiveView(True, total_steps=10, console=console) as view:
        view.update(3, STEP_VALUES)
    text = out.getvalue()
    for expected in ("kiln train", "3/10", "MirrorPop kept", "0.9", "verifier outcomes", "compile",
                     "rollout-0", "50%", "75%", "4,321", "BDR share"):
        assert expected in text, expected
    assert "step 3/10 |" not in text  # not the plain fallback


# ------------------------------------------------------------------------------------ episode dumps

TOK = ByteTokenizer()


def _task(task_id="L1_relu", repair=None):
    spec = KernelSpec(name="relu", reference="class Model: ...", backend="cpu", level=1)
    return Task(task_id=task_id, kind="kernel", kernel=spec, repair=repair)


def _turn(prompt, response, result, version=3):
    ids = np.array(TOK.render([Message("user", prompt)]), dtype=np.int64)
    resp = np.array(TOK.encode(response), dtype=np.int64)
    return Turn(prompt_ids=ids, response_ids=resp, logprobs=np.zeros(len(resp), np.float32),
                versions=np.full(len(resp), version, np.int64), finish_reason="stop", text=response, result=result)


def _result(passed, stage="done", error=None, q=1.0, score=1.0, eager=None, compile_=None, feedback="", **diag):
    return VerifyResult(request_id="r", task_id="L1_relu", passed=passed, stage=stage, error_class=error, q=q,
                        score=score, speedup_eager=eager, speedup_compile=compile_, feedback=feedback, diagnostics=diag)


def _episode(eid, rewards, turns, task=None, is_retry=False):
    return Episode(episode_id=eid, task=task or _task(), group_id="g7", sample_index=int(eid[-1]), turns=turns,
                   rewards=rewards, is_retry=is_retry, actor_id="rollout-1")


def test_episode_dump_is_readable_and_puts_the_highest_reward_first(tmp_path):
    failing = _turn("Write ModelNew for relu.", "```cpp\nbroken(\n```",
                    _result(False, "compile", "compile", 0.0, -1.0, feedback="error: expected ')' at line 1"))
    fixed = _turn("Your code failed to compile: expected ')'", "```cpp\nfixed\n```",
                  _result(True, eager=25.0, compile_=3.5, feedback="passed; 25x faster", review=True,
                          vendor_libs=["cublas"]), version=4)
    low = _episode("e0", [-1.0], [_turn("Write ModelNew for relu.", "no code here",
                                        _result(False, "extract", "extract", 0.0, -1.0))])
    high = _episode("e1", [-1.0, 1.5], [failing, fixed], is_retry=True,
                    task=_task(repair=RepairContext(failed_code="x", feedback="all 8 samples failed to compile",
                                                    attempt=1, origin_group="g3")))
    path = dump_episodes(tmp_path, 12, [low, high], TOK.decode, limit=5)
    assert path == tmp_path / "episodes" / "step-000012.txt"
    text = path.read_text()
    assert text.index("episode e1") < text.index("episode e0")  # highest reward first
    for expected in ("task L1_relu (relu)", "group g7", "[BDR retry]", "rewards per turn: -1.000, +1.500",
                     "retry of group g3 (attempt 1)", "all 8 samples failed to compile",
                     "Write ModelNew for relu.", "    ```cpp\n    broken(", "failed at stage compile, error compile",
                     "error: expected ')' at line 1", "PASSED at stage done", "speedup vs eager 25.00x, vs compile 3.50x",
                     "FLAGGED FOR HUMAN REVIEW", "cublas", "(v4-v4, finish: stop)", "failed at stage extract, error extract",
                     "score -1.000", "q 0.00"):
        assert expected in text, expected


def test_episode_dump_limit_truncation_and_bad_tokens(tmp_path):
    long_prompt = "HEAD " + "x" * 5000 + " TAIL"
    episodes = [_episode(f"e{i}", [float(i)], [_turn(long_prompt, f"answer {i}", None)]) for i in range(4)]
    path = dump_episodes(tmp_path, 3, episodes, TOK.decode, limit=2)
    text = path.read_text()
    assert "episode e3" in text and "episode e2" in text and "episode e1" not in text
    assert "HEAD" in text and "TAIL" in text and "characters cut" in text and "x" * 5000 not in text
    assert "verdict: none" in text
    assert dump_episodes(tmp_path, 4, episodes, TOK.decode, limit=0) is None
    assert dump_episodes(tmp_path, 5, [], TOK.decode, limit=3) is None
    assert sorted(p.name for p in (tmp_path / "episodes").iterdir()) == ["step-000003.txt"]

    def broken_decode(ids):
        raise ValueError("unknown id")

    text = dump_episodes(tmp_path, 6, episodes[:1], broken_decode, limit=1).read_text()
    assert "<could not decode" in text and "answer 0" in text  # the turn's text survives


# ------------------------------------------------------------------------------------ evaluation


def _v(passed, eager=None, compile_=None, error=None):
    error = error if error is not None else (None if passed else "correctness")
    return VerifyResult(request_id="r", task_id="t", passed=passed, stage="done" if passed else "correctness",
                        error_class=error, q=1.0 if passed else 0.0, score=1.0 if passed else -1.0,
                        speedup_eager=eager, speedup_compile=compile_)


def test_pass_at_k_matches_hand_computed_values():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(3, 1, 3) == 1.0  # fewer than k failures: some draw must pass
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    for bad in ((2, 3, 1), (2, 1, 3), (2, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_eval_metrics_hand_computed():
    results = {
        # 2 of 4 pass: pass@2 = 1 - C(2,2)/C(4,2) = 5/6; one fast vs eager, none vs compile.
        "A": [_v(True, 1.5, 0.8), _v(True, 0.9, None), _v(False), _v(False, eager=2.0)],
        # 0 of 2 (the infra verdict is dropped): all zeros.
        "B": [_v(False), _v(False), _v(False, error="infra")],
        # one sample < k = 2: skipped.
        "C": [_v(True, 3.0, 3.0)],
    }
    m = eval_metrics(results, k=2)
    assert m["eval/pass@2"] == pytest.approx((5 / 6 + 0) / 2)
    assert m["eval/avg@2"] == pytest.approx((2 / 4 + 0) / 2)
    assert m["eval/fast1_eager"] == pytest.approx((1 / 4 + 0) / 2)  # a failed sample's 2.0x does not count
    assert m["eval/fast1_compile"] == 0.0
    assert (m["eval/tasks"], m["eval/tasks_skipped"], m["eval/samples"], m["eval/infra"]) == (2, 1, 6, 1)
    assert fast_p(results["A"], "eager") == 0.25


def test_eval_metrics_leaves_out_unmeasured_columns_and_empty_evaluations():
    m = eval_metrics({"A": [_v(True), _v(False)], "B": [_v(True), _v(True)]}, k=1)
    assert m["eval/pass@1"] == pytest.approx(0.75) and m["eval/avg@1"] == pytest.approx(0.75)
    assert "eval/fast1_eager" not in m and "eval/fast1_compile" not in m
    empty = eval_metrics({"A": [_v(False, error="infra")]}, k=1)
    assert empty == {"eval/tasks": 0.0, "eval/tasks_skipped": 1.0, "eval/samples": 0.0, "eval/infra": 1.0}
    with pytest.raises(ValueError):
        eval_metrics({}, k=0)


# ------------------------------------------------------------------------------------ report


def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_from_a_full_run(tmp_path):
    with MetricsLog(tmp_path, LoggingConfig(tensorboard=False)) as metrics:
        for step in range(1, 5):
            metrics.log(step, {
                "train/loss": 1.0 / step, "train/kept_fraction": 0.9, "train/clip_low_fraction": 0.05,
                "train/clip_high_fraction": 0.1, "train/is_truncated_fraction": 0.01, "train/grad_norm": 0.5,
                "train/entropy": 2.0 - 0.1 * step, "train/response_length": 40.0 + step,
                "train/tokens_per_s": 900.0, "weights/version": step, "rollout/samples_per_s": 2.0 * step,
                "rollout/tokens_per_s": 500.0 * step, "reward/mean": -1 + 0.25 * step, "reward/pass_rate": 0.1 * step,
                "verifier/compile": 4 - step, "verifier/done": step, "verifier/passed": step,
                "verifier/error/compile": 4 - step, "staleness/mean": 0.5, "staleness/max": 1,
                "staleness/lag_0": 3, "staleness/lag_1": 1, "replay/bdr_share": 0.25,
                "run/distinct_sources": 10 * step, "run/untied_groups": step,
            })
        metrics.log(2, {"eval/pass@4": 0.2, "eval/avg@4": 0.1, "eval/fast1_eager": 0.05, "eval/tasks": 3})
        metrics.log(4, {"eval/pass@4": 0.5, "eval/avg@4": 0.3, "eval/fast1_eager": 0.2,
                        "eval/fast1_compile": 0.1, "eval/tasks": 3})
    (tmp_path / "config.yaml").write_text("algo: {}\n")
    dump_episodes(tmp_path, 4, [_episode("e1", [1.0], [_turn("p", "r", None)])], TOK.decode, limit=1)
    path = write_report(tmp_path)
    text = path.read_text()
    assert path == tmp_path / "report.md"
    assert "[the resolved config](config.yaml)" in text and "[step-000004.txt](episodes/step-000004.txt)" in text
    for expected in ("| steps logged | 4 (steps 1..4) |", "| weight versions | 4 |", "| distinct compiled sources | 40 |",
                     "| untied groups (rewards not all equal) | 4 |", "| final pass rate | 0.4 |",
                     "| step | pass@4 | avg@4 | fast_1 eager | fast_1 compile | tasks |",
                     "| 2 | 0.2 | 0.1 | 0.05 | - | 3 |", "| 4 (final) | **0.5** | **0.3** | **0.2** | **0.1** | **3** |"):
        assert expected in text, expected
    for name in ("reward", "verifier", "throughput", "staleness", "training"):
        assert f"(plots/{name}.png)" in text and _is_png(tmp_path / "plots" / f"{name}.png")
    assert "Not recorded" not in text


def test_report_with_few_keys_says_what_is_missing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "reward/mean": 0.5}\n{"step": 2, "time": 3.0, "re')
    text = write_report(tmp_path).read_text()
    assert "| steps logged | 1 (steps 1..1) |" in text and "| final loss | not recorded |" in text
    assert "No validation run was recorded" in text
    assert "(plots/reward.png)" in text and "(plots/verifier.png)" not in text
    missing = text.split("## Not recorded in this run")[1]
    for key in ("`reward/pass_rate`", "`verifier/<stage>`", "`rollout/samples_per_s`", "`staleness/lag_<k>`", "`train/loss`"):
        assert key in missing, key
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["reward.png"]


def test_report_of_an_empty_run(tmp_path):
    text = write_report(tmp_path).read_text()
    assert "No metrics were recorded" in text
    assert list((tmp_path / "plots").iterdir()) == []


# ------------------------------------------------------------------------------------ busy fractions


def test_busy_shares_count_a_restarted_actors_counter_from_zero():
    from types import SimpleNamespace

    from launch.monitor import busy_shares

    counters = {"learner": 10.0, "rollout-0": 50.0}
    handles = [SimpleNamespace(name=name, health=lambda timeout_s, name=name: SimpleNamespace(busy_s=counters[name]))
               for name in counters]
    previous: dict[str, float] = {}
    assert busy_shares(handles, previous, 10.0) == {}  # the first reading only sets the baseline
    counters.update({"learner": 12.0, "rollout-0": 6.0})  # rollout-0 was restarted: its counter began again
    assert busy_shares(handles, previous, 10.0) == {"busy/learner": pytest.approx(0.2),
                                                    "busy/rollout-0": pytest.approx(0.6)}
    counters.update({"learner": 30.0, "rollout-0": 11.0})
    assert busy_shares(handles, previous, 10.0) == {"busy/learner": 1.0, "busy/rollout-0": pytest.approx(0.5)}
