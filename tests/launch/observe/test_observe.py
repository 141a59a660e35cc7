"""Observability of a training run: the metrics stream, the live view, episode dumps, validation
metrics and the end-of-run report (launch/observe/metrics.py, live.py, episode_dump.py,
report.py)."""

from __future__ import annotations

import html
import importlib.util
import io
import json
import logging
import re
import time

import matplotlib.colors
import numpy as np
import pytest
from rich.console import Console

from actors.policy.tokenizer import ByteTokenizer, Message
from configs import AlgoConfig, LoggingConfig
from launch.observe.episode_dump import EpisodeDumper, read_index
from launch.observe.live import LiveView
from launch.observe.metrics import MetricsLog, read_metrics
from launch.observe.report import write_report
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


# ------------------------------------------------------------------------------------ live view

STEP_VALUES = {
    "weights/version": 3,
    "rollout/samples_per_s": 12.5,
    "rollout/tokens_per_s": 4321.0,
    "reward/mean": 0.375,
    "reward/pass_rate": 0.25,
    "verifier/compile": 2,
    "verifier/done": 1,
    "verifier/error/compile": 2,
    "staleness/mean": 0.5,
    "staleness/max": 1,
    "replay/bdr_share": 0.125,
    "train/kept_fraction": 0.9,
    "busy/rollout-0": 0.5,
    "busy/verifier-0": 0.75,
}


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def test_live_view_prints_one_plain_line_per_step_with_elapsed_time_and_eta():
    out, clock = io.StringIO(), Clock()
    with LiveView(False, total_steps=10, stream=out, started=40.0, clock=clock) as view:
        view.update(3, STEP_VALUES)
        clock.now = 130.0
        view.update(4, {"weights/version": 4})  # other keys keep their last value; no verdicts this step
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        "step 3/10 (elapsed 0:01:00) | weights v 3 | samples/s 12.5 | tokens/s 4,321 | reward 0.375"
    )
    assert "pass rate 0.25" in lines[0] and "BDR share 0.125" in lines[0] and "MirrorPop kept 0.9" in lines[0]
    assert "verdicts passed 1, compile 2" in lines[0]
    assert "busy rollout-0 50% verifier-0 75%" in lines[0]
    # 30 s per step, 6 steps to go
    assert lines[1].startswith("step 4/10 (elapsed 0:01:30, ETA 0:03:00) | weights v 4 | samples/s 12.5")
    assert "verdicts" not in lines[1]  # a step's verifier counts are that step's, never carried over


def test_a_row_without_rates_keeps_the_last_rates_shown():
    # the run's last step: no group finished in its window, so the monitor reports no rate (not 0)
    out = io.StringIO()
    with LiveView(False, total_steps=2, stream=out) as view:
        view.update(1, {"rollout/samples_per_s": 2.5, "busy/rollout-0": 0.8})
        view.update(2, {"train/loss": 0.1})
    assert "samples/s 2.5" in out.getvalue().splitlines()[1] and "rollout-0 80%" in out.getvalue().splitlines()[1]


def test_live_view_without_a_terminal_falls_back_to_plain_lines():
    out = io.StringIO()
    with LiveView(True, total_steps=5, stream=out, clock=Clock()) as view:  # a StringIO is no terminal
        view.update(1, {"reward/mean": 0.5})
    assert out.getvalue() == "step 1/5 (elapsed 0:00:00) | reward 0.5\n"


def test_progress_rows_and_the_warning_in_plain_lines():
    out, clock = io.StringIO(), Clock()
    with LiveView(False, total_steps=4, stream=out, started=0.0, clock=clock) as view:
        view.progress(
            {
                "progress/groups": 12,
                "progress/episodes": 48,
                "progress/filtered/tied": 12,
                "progress/pass_rate": 0.0,
                "progress/verdict/extract": 96,
            },
            "no progress: ...extract...",
        )
        view.progress({"progress/groups": 14}, "no progress: ...extract...")  # the same warning: printed once
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "progress (elapsed 0:01:40) | groups 12 | episodes 48 | pass rate 0 | filtered tied 12 | verdicts extract 96"
    )
    assert lines[1] == "WARNING no progress: ...extract..."
    assert lines[2].startswith("progress (elapsed 0:01:40) | groups 14") and len(lines) == 3


def test_live_view_on_a_terminal_draws_the_rich_panel():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    with LiveView(True, total_steps=10, console=console, clock=Clock()) as view:
        view.update(3, STEP_VALUES)
        view.progress({"progress/groups": 7, "progress/filtered/tied": 2}, "no progress: the last 32 groups tied")
    text = out.getvalue()
    for expected in (
        "kiln train",
        "3/10",
        "elapsed",
        "MirrorPop kept",
        "0.9",
        "verifier outcomes",
        "this step",
        "compile",
        "passed",
        "rollout-0",
        "50%",
        "75%",
        "4,321",
        "BDR share",
        "rollout side",
        "filtered tied",
        "no progress: the last 32 groups tied",
    ):
        assert expected in text, expected
    assert "step 3/10 |" not in text  # not the plain fallback
    # one row per outcome: headers never wider than a narrow terminal's columns
    narrow = io.StringIO()
    with LiveView(
        True,
        total_steps=10,
        console=Console(file=narrow, force_terminal=True, width=60, color_system=None),
        clock=Clock(),
    ) as view:
        view.update(
            3,
            {**STEP_VALUES, "verifier/error/correctness": 3, "verifier/error/cheating": 1, "verifier/error/timeout": 1},
        )
    table = narrow.getvalue()
    for outcome in ("passed", "compile", "timeout", "correctness", "cheating"):
        assert re.search(rf"│\s+{outcome}\s+│\s+\d+\s+│\s+\d+", table), outcome  # the whole name, then its counts


# ------------------------------------------------------------------------------------ episode dumps

TOK = ByteTokenizer()


def _task(task_id="L1_relu", repair=None):
    spec = KernelSpec(name="relu", reference="class Model: ...", backend="cpu", level=1)
    return Task(task_id=task_id, kind="kernel", kernel=spec, repair=repair)


def _turn(prompt, response, result, version=3):
    ids = np.array(TOK.render([Message("user", prompt)]), dtype=np.int64)
    resp = np.array(TOK.encode(response), dtype=np.int64)
    return Turn(
        prompt_ids=ids,
        response_ids=resp,
        logprobs=np.zeros(len(resp), np.float32),
        versions=np.full(len(resp), version, np.int64),
        finish_reason="stop",
        text=response,
        result=result,
    )


def _result(passed, stage="done", error=None, q=1.0, score=1.0, eager=None, compile_=None, feedback="", **diag):
    return VerifyResult(
        request_id="r",
        task_id="L1_relu",
        passed=passed,
        stage=stage,
        error_class=error,
        q=q,
        score=score,
        speedup_eager=eager,
        speedup_compile=compile_,
        feedback=feedback,
        diagnostics=diag,
    )


def _episode(eid, rewards, turns, task=None, is_retry=False, group="g7"):
    return Episode(
        episode_id=eid,
        task=task or _task(),
        group_id=group,
        sample_index=int(eid[-1]),
        turns=turns,
        rewards=rewards,
        is_retry=is_retry,
        actor_id="rollout-1",
    )


def _dumper(tmp_path, per_step=4, **algo):
    return EpisodeDumper(tmp_path, AlgoConfig(**algo), TOK.decode, per_step=per_step)


def _failed(stage="compile", error="compile", feedback="error: expected ')' at line 1"):
    return _result(False, stage, error, 0.0, -1.0, feedback=feedback)


@pytest.mark.parametrize("step_first", [False, True], ids=["episodes-first", "step-first"])
def test_an_episode_reads_as_a_conversation_with_its_verdicts_reward_terms_and_fate(tmp_path, step_first):
    failing = _turn("Write ModelNew for relu.", "```cpp\nbroken(\n```", _failed())
    fixed = _turn(
        "Your code failed to compile: expected ')'",
        "```cpp\nfixed\n```",
        _result(True, eager=25.0, compile_=3.5, feedback="passed; 25x faster", review=True, vendor_libs=["cublas"]),
        version=4,
    )
    repaired = _episode(
        "e1",
        [-1.0, 1.5],
        [failing, fixed],
        is_retry=True,
        task=_task(
            repair=RepairContext(
                failed_code="x", feedback="all 8 samples failed to compile", attempt=1, origin_group="g3"
            )
        ),
    )
    low = _episode(
        "e0",
        [-1.0],
        [_turn("Write ModelNew for relu.", "no code here", _failed("extract", "extract", ""))],
        is_retry=True,
        task=repaired.task,
    )
    dumper = _dumper(tmp_path)
    fates = {"trained": ["e1"], "mirrorpop_dropped": ["e0"]}
    if step_first:  # the step's row (from the learner) reached the driver before the episodes did
        dumper.learner_step(12, 5, fates)
        dumper.add([low, repaired])
    else:
        dumper.add([low, repaired])
        dumper.learner_step(12, 5, fates)
    path = dumper.dump(12)
    assert path == tmp_path / "episodes" / "step-000012.txt"
    text = path.read_text()
    e1 = text[text.index("episode e1") :]
    e1 = e1[: e1.index("=" * 100)] if "=" * 100 in e1 else e1
    for expected in (
        "task L1_relu (relu)",
        "group g7",
        "[BDR retry]",
        "retry of group g3 (served 1 time(s)",
        "all 8 samples failed to compile",
        "prompt (as the chat template rendered it):",
        "Write ModelNew for relu.",
        "    ```cpp\n    broken(",
        "failed at stage compile, error compile",
        "error: expected ')' at line 1",
        "PASSED at stage done",
        "speedup vs eager 25.00x, vs compile 3.50x",
        "FLAGGED FOR HUMAN REVIEW",
        "cublas",
        "(v4-v4, finish: stop)",
        "q 0.00, score s -1.000",
        "reward: s per turn -1.000, +1.500",
        # R = 0.75·(-1) + 0.25·1.5 + b_early (a first pass at turn 2: 0.1)
        "PrimeEcho R = α·s_first + (1-α)·max s + b_early = -0.750 + +0.375 + +0.100 = -0.275",
        # a group of two, R = -1 and -0.275: std-normalised advantages ±1
        "advantage +1.000 in its group of 2 (R: -1.000, -0.275)",
        # trained for version 5; its oldest gradient token (turn 1) came from version 3
        "trained at step 12 (lag 2)",
        "shows: repair turn passed, retry, retry group trained",
        "first to show: retry, retry group trained, repair turn passed",
    ):
        assert expected in e1, expected
    assert "dropped by MirrorPop at step 12" in text and "failed at stage extract, error extract" in text
    rows = read_index(tmp_path)
    assert {r["episode_id"] for r in rows} == {"e0", "e1"} and all(r["file"] == "step-000012.txt" for r in rows)
    assert "MirrorPop dropped" in next(r for r in rows if r["episode_id"] == "e0")["tags"]


def test_dumps_are_chosen_by_kind_and_each_mechanism_is_shown_once(tmp_path):
    ok = _result(True)
    dumper = _dumper(tmp_path, per_step=2)
    dumper.add(
        [  # g1: a pass and a failure (untied); g2: all failed (tied: the task enters the retry buffer)
            _episode("a0", [1.0], [_turn("p", "good", ok)], group="g1"),
            _episode("a1", [-1.0], [_turn("p", "bad", _failed())], group="g1"),
            _episode("b0", [-1.0], [_turn("p", "cheat", _failed("legality", "cheating"))], group="g2"),
            _episode("b1", [-1.0], [_turn("p", "cheat", _failed("legality", "cheating"))], group="g2"),
        ]
    )
    dumper.dump(1)
    first = {r["episode_id"]: r for r in read_index(tmp_path)}
    # the first episode of each mechanism shown (compile; all-failed, tied and cheating), then the best
    assert set(first) == {"a1", "b0", "a0"}, first
    assert first["a1"]["why"] == ["first to show: verdict compile", "worst"] and first["a0"]["why"] == ["best"]
    assert {"all-failed group", "tied group", "verdict cheating"} <= set(first["b0"]["tags"])
    # a later step: its best, its worst, a retry; compile was shown at step 1, so not again as a first
    retry_task = _task(repair=RepairContext(failed_code="cheat", feedback="fallback", attempt=1, origin_group="g2"))
    dumper.add(
        [
            _episode("c0", [1.0], [_turn("p", "good", ok)], task=retry_task, is_retry=True, group="g3"),
            _episode("c1", [-1.0], [_turn("p", "bad", _failed())], task=retry_task, is_retry=True, group="g3"),
        ]
    )
    dumper.dump(2)
    second = [r for r in read_index(tmp_path) if r["step"] == 2]
    assert [r["episode_id"] for r in second] == ["c0", "c1"]
    assert second[0]["why"] == ["first to show: retry", "best", "a retry"] and second[1]["why"] == ["worst"]
    assert "first to show" not in " ".join(second[1]["why"])
    assert _dumper(tmp_path)._shown >= {"verdict compile", "retry"}  # a resumed run remembers what is shown
    assert _dumper(tmp_path, per_step=0).dump(3) is None


def test_episode_dump_truncation_and_bad_tokens(tmp_path):
    long_prompt = "HEAD " + "x" * 5000 + " TAIL"
    episodes = [
        _episode(f"e{i}", [float(i)], [_turn(long_prompt, f"answer {i}", None)], group=f"g{i}") for i in range(4)
    ]
    dumper = _dumper(tmp_path, per_step=2)
    dumper.add(episodes)
    text = dumper.dump(3).read_text()
    assert "episode e3" in text and "episode e0" in text and "episode e1" not in text  # best and worst
    assert "HEAD" in text and "TAIL" in text and "characters cut" in text and "x" * 5000 not in text
    assert "verdict: none" in text and "advantage: not shown" in text

    def broken_decode(ids):
        raise ValueError("unknown id")

    broken = EpisodeDumper(tmp_path / "b", AlgoConfig(), broken_decode, per_step=1)
    broken.add(episodes[:1])
    text = broken.dump(6).read_text()
    assert "<could not decode" in text and "answer 0" in text  # the turn's text survives


# ------------------------------------------------------------------------------------ report


def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _full_run(run_dir, steps=4):
    with MetricsLog(run_dir, LoggingConfig(tensorboard=False)) as metrics:
        for step in range(1, steps + 1):
            metrics.log(
                step,
                {
                    "train/loss": 1.0 / step,
                    "train/kept_fraction": 0.9,
                    "train/clip_low_fraction": 0.05,
                    "train/clip_high_fraction": 0.1,
                    "train/is_truncated_fraction": 0.01,
                    "train/grad_norm": 0.5,
                    "train/grad_norm_max": 0.7,
                    "train/entropy": 2.0 - 0.1 * step,
                    "train/response_length": 40.0 + step,
                    "train/tokens_per_s": 900.0,
                    "train/step_s": 2.0,
                    "weights/version": step,
                    "rollout/samples_per_s": 2.0 * step,
                    "rollout/tokens_per_s": 500.0 * step,
                    "reward/mean": -1 + 0.25 * step,
                    "reward/pass_rate": 0.1 * step,
                    "verifier/compile": 4 - step,
                    "verifier/done": step,
                    "verifier/error/compile": 4 - step,
                    "verifier/error/timeout": 1,
                    "staleness/mean": 0.5,
                    "staleness/max": 1,
                    "staleness/lag_0": 3,
                    "staleness/lag_1": 1,
                    "replay/bdr_share": 0.25,
                    "train/mirrorpop_dropped": 1,
                    "train/off_policy_kept": 2,
                    "train/clipped": 5,
                    "rollout/repair_passes": step % 2,
                    "replay/retry_admitted": step,
                    "replay/retry_served": step - 1,
                    "replay/retry_trained": 0,
                    "replay/filtered_groups/tied": step,
                    "run/distinct_sources": 10 * step,
                    "run/untied_groups": step,
                    "busy/learner": 0.5,
                    "busy/rollout-0": 0.9,
                },
            )
            metrics.log(
                step,
                {
                    "progress/elapsed_s": 30.0 * step,
                    "progress/groups": 3.0 * step,
                    "progress/trainable": 2.0 * step,
                    "progress/filtered/tied": float(step),
                    "progress/pass_rate": 0.25,
                    "progress/verdict/passed": 1.0,
                    "progress/verdict/compile": 3.0,
                    "progress/decoded_tokens_per_s": 50.0,
                    "progress/retry_buffer": 1.0,
                },
                tb_step=30 * step,
            )
        metrics.log(2, {"eval/pass@4": 0.2, "eval/avg@4": 0.1, "eval/faster_eager": 0.05, "eval/tasks": 3})
        metrics.log(
            4,
            {
                "eval/pass@4": 0.5,
                "eval/avg@4": 0.3,
                "eval/faster_eager": 0.2,
                "eval/faster_compile": 0.1,
                "eval/tasks": 3,
            },
        )


def test_report_from_a_full_run(tmp_path):
    _full_run(tmp_path)
    (tmp_path / "config.yaml").write_text("algo: {}\n")
    (tmp_path / "summary.json").write_text(json.dumps({"wall_s": 123.4, "warnings": ["no progress: tied"]}))
    dumper = _dumper(tmp_path)
    dumper.add(
        [
            _episode("e1", [-1.0], [_turn("p", "r", _failed())], group="g1"),
            _episode("e2", [1.0], [_turn("p", "r", _result(True))], group="g1"),
        ]
    )
    dumper.dump(4)
    path = write_report(tmp_path)
    text = path.read_text()
    assert path == tmp_path / "report.md"
    assert "[the resolved config](config.yaml)" in text and "[step-000004.txt](episodes/step-000004.txt)" in text
    for expected in (
        "| learner steps | 4 (steps 1..4) |",
        "| wall time (this session, as `kiln train` printed it) | 123 s |",
        "| weight versions | 4 |",
        "| groups completed | 12 |",
        "| distinct compiled sources | 40 |",
        "| untied groups (rewards not all equal) | 4 |",
        "| final pass rate | 0.4 |",
        "## Warnings",
        "* no progress: tied",
        "| step | pass@4 | avg@4 | faster eager | faster compile | tasks |",
        "| 2 | 0.2 | 0.1 | 0.05 | - | 3 |",
        "| 4 (final) | **0.5** | **0.3** | **0.2** | **0.1** | **3** |",
        # the mechanisms: run totals from the last row, per-step counts summed
        "| Buffered Dynamic Retry: an all-failed group enters the retry buffer | 4 groups | no dump",
        "| Buffered Dynamic Retry: a repair task from the buffer is served | 3 groups | no dump",
        "| Buffered Dynamic Retry: a repair group is trained | 0 | - |",
        "| MirrorPop drops a sequence (mean \\|log π_prox - log μ\\| > δ) | 4 sequences | no dump",
        "| verdict: compile error | 6 attempts | [step-000004.txt](episodes/step-000004.txt) `e1` |",
        "| verdict: timeout | 4 attempts | no dump",
        "| PPO clip: a token's ratio is clipped | 20 token-updates | - |",
        "| a repair turn passes (after a failed turn) | 2 episodes |",
    ):
        assert expected in text, expected
    for name in (
        "reward",
        "verifier",
        "progress",
        "throughput",
        "timeline",
        "staleness",
        "training",
        "policy",
        "corrections",
    ):
        assert f"(plots/{name}.png)" in text and _is_png(tmp_path / "plots" / f"{name}.png"), name
    assert "Not recorded" not in text
    # report.html: the same sections and tables, the plots embedded
    page = (tmp_path / "report.html").read_text()
    for heading in re.findall(r"^## (.+)$", text, re.MULTILINE):
        assert f"<h2>{html.escape(heading)}</h2>" in page, heading
    assert page.count("<img ") == text.count("![") == 9 and "data:image/png;base64," in page
    assert '<a href="episodes/step-000004.txt">step-000004.txt</a> <code>e1</code>' in page
    assert "<td>4 (steps 1..4)</td>" in page and "mean |log π_prox - log μ| &gt; δ" in page


def test_plots_have_titles_units_integer_steps_and_fixed_outcome_colours(tmp_path, monkeypatch):
    from launch.observe import report_plots
    from launch.observe.outcomes import COLOURS

    figures = {}

    def keep(plt, fig, path):
        figures[path.name] = fig
        fig.canvas.draw()
        return path

    monkeypatch.setattr(report_plots, "_save", keep)
    _full_run(tmp_path, steps=3)
    rows = read_metrics(tmp_path)
    series = report_plots.step_series(rows)
    for _, draw in report_plots.PLOTS:
        draw(series, rows, tmp_path, tmp_path)
    assert set(figures) == {
        "reward.png",
        "verifier.png",
        "progress.png",
        "throughput.png",
        "timeline.png",
        "staleness.png",
        "training.png",
        "policy.png",
        "corrections.png",
    }
    for name, fig in figures.items():
        assert fig._suptitle is not None and fig._suptitle.get_text(), name
        for ax in fig.axes:
            if ax.get_label() == "<colorbar>":
                continue
            assert ax.get_ylabel() or ax.get_yticklabels(), (name, "no y unit")
    for name in ("reward.png", "verifier.png", "throughput.png", "training.png", "policy.png", "corrections.png"):
        ticks = [t for t in figures[name].axes[-1].get_xticks() if 0.5 <= t <= 3.5]
        assert ticks == [1.0, 2.0, 3.0], (name, ticks)  # three steps: ticks 1, 2, 3, never 1.5
    for name in ("verifier.png", "progress.png"):  # one colour per outcome, whatever the panel
        for ax in figures[name].axes:
            for container in ax.containers:
                label = container.get_label()
                colour = matplotlib.colors.to_hex(container.patches[0].get_facecolor())
                assert colour == COLOURS[label], (name, label, colour)


def test_report_with_few_keys_says_what_is_missing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "time": 1.0, "reward/mean": 0.5}\n{"step": 2, "time": 3.0, "re'
    )
    text = write_report(tmp_path, html=False).read_text()
    assert "| learner steps | none |" in text and "| final loss | not recorded |" in text
    assert "| wall time (this session, as `kiln train` printed it) | 0 s (first to last metrics row) |" in text
    assert "No validation run was recorded" in text
    assert "(plots/reward.png)" in text and "(plots/verifier.png)" not in text
    missing = text.split("## Not recorded in this run")[1]
    for key in (
        "`reward/pass_rate`",
        "`verifier/done`",
        "`rollout/samples_per_s`",
        "`staleness/lag_<k>`",
        "`train/loss`",
        "`progress/*`",
        "`train/entropy`",
        "`train/clip_low_fraction`",
    ):
        assert key in missing, key
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["reward.png"]
    assert not (tmp_path / "report.html").exists()


def test_report_of_an_empty_run(tmp_path):
    text = write_report(tmp_path).read_text()
    assert "No metrics were recorded" in text
    assert list((tmp_path / "plots").iterdir()) == []


# ------------------------------------------------------------------------------------ busy fractions


def test_busy_shares_count_a_restarted_actors_counter_from_zero():
    from types import SimpleNamespace

    from launch.driver.monitor import busy_shares

    counters = {"learner": 10.0, "rollout-0": 50.0}
    handles = [
        SimpleNamespace(name=name, health=lambda timeout_s, name=name: SimpleNamespace(busy_s=counters[name]))
        for name in counters
    ]
    previous: dict[str, float] = {}
    assert busy_shares(handles, previous, 10.0) == {}  # the first reading only sets the baseline
    counters.update({"learner": 12.0, "rollout-0": 6.0})  # rollout-0 was restarted: its counter began again
    assert busy_shares(handles, previous, 10.0) == {
        "busy/learner": pytest.approx(0.2),
        "busy/rollout-0": pytest.approx(0.6),
    }
    counters.update({"learner": 30.0, "rollout-0": 11.0})
    assert busy_shares(handles, previous, 10.0) == {"busy/learner": 1.0, "busy/rollout-0": pytest.approx(0.5)}


def test_the_timeline_draws_recorded_spans_when_the_run_has_them(tmp_path, monkeypatch):
    from launch.observe import report_plots

    _full_run(tmp_path, steps=2)
    rows = read_metrics(tmp_path)
    coarse = report_plots.timeline_spans(tmp_path, rows)  # from metrics.jsonl: steps and busy shares
    assert {(s.actor, s.activity) for s in coarse} == {("learner", "training"), ("rollout-0", "busy")}
    spans = [
        {"actor": "rollout-0", "activity": "generating", "start": 10.0, "end": 14.5, "units": 1},
        {"actor": "verifier-0", "activity": "verifying", "start": 12.0, "end": 13.0, "units": 2},
        {"actor": "learner", "activity": "training", "start": 14.5, "end": 16.0, "units": 1},
    ]
    (tmp_path / "timeline.jsonl").write_text("\n".join(json.dumps(s) for s in spans) + '\n{"actor": "learn')
    exact = report_plots.timeline_spans(tmp_path, rows)  # the torn last line is skipped
    assert [(s.actor, s.activity, s.start, s.end, s.share) for s in exact] == [
        ("rollout-0", "generating", 10.0, 14.5, 1.0),
        ("verifier-0", "verifying", 12.0, 13.0, 1.0),
        ("learner", "training", 14.5, 16.0, 1.0),
    ]
    figures = {}
    monkeypatch.setattr(report_plots, "_save", lambda plt, fig, path: figures.setdefault(path.name, fig) and path)
    report_plots.plot_timeline(tmp_path, rows, tmp_path)
    ax = figures["timeline.png"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["learner", "rollout-0", "verifier-0"]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["generating", "training", "verifying"]


def test_per_step_plots_span_every_learner_step_also_one_without_rollout_figures(tmp_path, monkeypatch):
    from launch.observe import report_plots

    _full_run(tmp_path, steps=2)
    with MetricsLog(tmp_path, LoggingConfig(tensorboard=False)) as metrics:  # a last step with no group finished
        metrics.log(3, {"train/loss": 0.1, "weights/version": 3, "train/grad_norm": 0.5})
    rows = read_metrics(tmp_path)
    figures = {}
    monkeypatch.setattr(report_plots, "_save", lambda plt, fig, path: figures.setdefault(path.name, fig) and path)
    series = report_plots.step_series(rows)
    report_plots.plot_reward(series, tmp_path)
    report_plots.plot_verifier(series, tmp_path)
    for name in ("reward.png", "verifier.png"):
        ax = figures[name].axes[-1]
        assert list(ax.get_xticks()) == [1, 2, 3] and ax.get_xlim()[1] > 3, name
