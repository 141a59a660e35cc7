"""`kiln eval` end to end on the cpu backend: answer sets (shipped solutions and their broken
variants), a checkpoint (the tiny real-format chat model), a KernelBench-layout tree, resuming a
killed evaluation, --compare, and the in-run validation sharing the same code (launch/stages/eval/)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
SOLUTIONS = ROOT / "tasks" / "solutions" / "cpu"


def task_tree(root: Path, files: list[str]) -> Path:
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "tasks" / rel, root / rel)
    return root


def write_answers(path: Path, tasks: Path, *, variants: bool) -> Path:
    from launch.stages.eval.answers import main as answers_main

    assert (
        answers_main(
            ["--tasks", str(tasks), "--solutions", str(SOLUTIONS), "--out", str(path)]
            + (["--variants"] if variants else [])
        )
        == 0
    )
    return path


def run_eval(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["eval", *args])
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def variants_eval(tmp_path_factory, verifier_cache_dir):
    """The shipped cpu solutions of level1/01_relu and level2/06_rmsnorm with their broken variants."""
    base = tmp_path_factory.mktemp("variants")
    tasks = task_tree(base / "tasks", ["level1/01_relu.py", "level2/06_rmsnorm.py"])
    (tasks / "level2" / "07_broken.py").write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    answers = write_answers(base / "answers.jsonl", tasks, variants=True)
    with open(answers, "a") as f:  # an answer to a task not loaded is listed and left out, never fatal
        f.write(json.dumps({"task_id": "level9/nothing", "sample": 0, "text": "x"}) + "\n")
    out = base / "out"
    code = main(
        [
            "eval",
            "--answers",
            str(answers),
            "--tasks",
            str(tasks),
            "--backend",
            "cpu",
            "--k",
            "1,4",
            "--out",
            str(out),
            "--name",
            "shipped",
            f"verifier.cache_dir={verifier_cache_dir}",
            "verifier.run_timeout_s=5",
        ]
    )  # the `hang` variants each cost the run's time limit; the `crash` ones segfault at once
    return code, out, tasks, answers


def test_answers_from_shipped_solutions_and_variants_give_the_expected_table(variants_eval):
    code, out, _, _ = variants_eval
    assert code == 0
    by_sample = {(r["task_id"], r["sample"]): (r["stage"], r["error_class"]) for r in rows(out)}
    # relu: its kernel has no " + " to flip, so 6 answers: solution, compile error, endless loop,
    # null write, fallback, cut off; rmsnorm adds the wrong result
    assert by_sample == {
        ("level1/01_relu", 0): ("done", None),
        ("level1/01_relu", 1): ("compile", "compile"),
        ("level1/01_relu", 2): ("run", "timeout"),
        ("level1/01_relu", 3): ("run", "runtime"),
        ("level1/01_relu", 4): ("legality", "cheating"),
        ("level1/01_relu", 5): ("extract", "extract"),
        ("level2/06_rmsnorm", 0): ("done", None),
        ("level2/06_rmsnorm", 1): ("compile", "compile"),
        ("level2/06_rmsnorm", 2): ("correctness", "correctness"),
        ("level2/06_rmsnorm", 3): ("run", "timeout"),
        ("level2/06_rmsnorm", 4): ("run", "runtime"),
        ("level2/06_rmsnorm", 5): ("legality", "cheating"),
        ("level2/06_rmsnorm", 6): ("extract", "extract"),
    }
    table = (out / "table.md").read_text()
    # Pass@1: L1 1/6, L2 1/7, Overall their mean; Pass@4: L1 1 - C(5,4)/C(6,4) = 2/3, L2 1 - C(6,4)/C(7,4)
    # = 4/7; Avg per attempt: Overall 2/13; the compile baseline is not timed on cpu: n/a. Faster than eager
    # (> 1.1x): from each passing attempt's own speedup, which for a naive single-threaded loop against eager
    # on one thread is close to 1 and on either side of 1.1 with the machine's noise.
    fast = {
        tid: any(r["passed"] and (r["speedup_eager"] or 0) > 1.1 for r in rows(out) if r["task_id"] == tid)
        for tid in ("level1/01_relu", "level2/06_rmsnorm")
    }
    l1, l2 = 100.0 * fast["level1/01_relu"] / 6, 100.0 * fast["level2/06_rmsnorm"] / 7
    overall = 100.0 * (fast["level1/01_relu"] + fast["level2/06_rmsnorm"]) / 13
    assert (
        f"| shipped | 16.7 | 14.3 | 15.5 | 66.7 | 57.1 | 61.9 | 16.7 | 14.3 | 15.4 | {l1:.1f} | {l2:.1f} | {overall:.1f} "
        "| n/a | n/a | n/a |"
    ) in table
    assert "Overall pools every attempt of every level" in table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_loads"] == [
        {
            "path": str(out.parent / "tasks" / "level2" / "07_broken.py"),
            "reason": "defines no get_inputs(), get_init_inputs() at module level",
        }
    ]
    assert [line.split(":")[0] for line in summary["rejected_answers"]] == ["line 14"]
    assert summary["verifier"]["backend"] == "cpu" and summary["toolchain"]["torch"]
    assert summary["device"].startswith("cpu") and summary["counts"]["verified"] == 13
    assert (out / "chart.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "bad, says",
    [
        ("not json", "line 2: not JSON"),
        (json.dumps({"task_id": "level1/01_relu", "sample": -1, "text": "x"}), 'line 2: "sample" must be an integer'),
        (json.dumps({"task_id": "level1/01_relu", "sample": 0, "text": "again"}), "line 2: a second answer for"),
    ],
)
def test_a_malformed_answers_line_is_a_user_mistake_one_line_and_a_non_zero_exit(tmp_path, capsys, bad, says):
    """The README's rule: every user mistake is one line on stderr and a non-zero exit. A broken answers
    file is refused before anything is verified (a table over what is left would mislead)."""
    tasks = task_tree(tmp_path / "tasks", ["level1/01_relu.py"])
    answers = tmp_path / "answers.jsonl"
    good = json.dumps({"task_id": "level1/01_relu", "sample": 0, "text": "x"})
    answers.write_text(f"{good}\n{bad}\n{bad}\n")
    out = tmp_path / "out"
    code, _, err = run_eval(
        capsys, "--answers", str(answers), "--tasks", str(tasks), "--backend", "cpu", "--out", str(out)
    )
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"kiln eval: answers file {answers} {says}")
    assert "(and 1 more such line)" in err and "Traceback" not in err
    assert not out.exists()  # refused before the evaluation started


def test_the_progress_line_counts_the_tasks_the_answers_cover_not_every_task_loaded(
    tmp_path, capsys, verifier_cache_dir
):
    tasks = task_tree(tmp_path / "tasks", ["level1/01_relu.py", "level2/06_rmsnorm.py"])
    answers = tmp_path / "answers.jsonl"
    answers.write_text(
        "".join(json.dumps({"task_id": "level1/01_relu", "sample": s, "text": "no code"}) + "\n" for s in (0, 1))
    )
    args = ["--answers", str(answers), "--tasks", str(tasks), "--backend", "cpu", "--out", str(tmp_path / "out")]
    code, _, err = run_eval(capsys, *args, f"verifier.cache_dir={verifier_cache_dir}")
    assert code == 0
    assert "tasks 1/1  attempts 2/2" in err  # one task answered of the two loaded


def test_compare_prints_deltas_and_warns_on_other_settings(variants_eval, tmp_path, capsys):
    _, out, _, _ = variants_eval
    other = json.loads((out / "summary.json").read_text())
    other["name"], other["device"] = "other", "cpu: another machine"
    other["rows"][-1]["avg"] = 0.5
    (tmp_path / "b.json").write_text(json.dumps(other))
    code, text, err = run_eval(capsys, "--compare", str(out / "summary.json"), str(tmp_path / "b.json"))
    assert code == 0
    assert "| Δ (other − shipped) |" in text and "+34.6" in text  # 50.0 - 15.4 in the Avg Overall column
    assert "differ in device" in err and "verifier" not in err


def test_a_finished_evaluation_is_not_verified_again_and_other_settings_are_refused(
    variants_eval, capsys, verifier_cache_dir
):
    _, out, tasks, answers = variants_eval
    common = [
        "--answers",
        str(answers),
        "--tasks",
        str(tasks),
        "--backend",
        "cpu",
        "--out",
        str(out),
        f"verifier.cache_dir={verifier_cache_dir}",
        "verifier.run_timeout_s=5",
    ]
    code, text, _ = run_eval(capsys, *common, "--k", "1,4")
    assert code == 0 and "0 attempts verified now, 13 resumed" in text
    code, _, err = run_eval(capsys, *common, "verifier.trials=2")
    assert code == 2 and "other settings (verifier differ)" in err


def test_usage_errors_are_one_line(capsys, tmp_path):
    code, _, err = run_eval(capsys, "--model", str(tmp_path), "--tasks", "tasks", "--samples", "2", "--k", "1,4")
    assert code == 2 and err.count("\n") == 1 and "not a checkpoint directory" in err
    code, _, err = run_eval(capsys, "--answers", str(tmp_path / "missing.jsonl"), "--tasks", "tasks")
    assert code == 2 and "cannot read answers file" in err
    code, _, err = run_eval(capsys, "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert code == 2 and "cannot read" in err


def test_k_above_samples_is_refused(tiny_chat_model, capsys):
    code, _, err = run_eval(capsys, "--model", str(tiny_chat_model), "--tasks", "tasks", "--samples", "2", "--k", "1,4")
    assert code == 2 and "--k 4 exceeds --samples (2)" in err


def test_kernelbench_repository_layout_loads_and_evaluates(tmp_path, capsys, verifier_cache_dir):
    """A clone's root: tasks under KernelBench/levelN/ with KernelBench's file naming, beside scripts
    that mention get_inputs and are not tasks."""
    clone = tmp_path / "KernelBench"
    level1 = clone / "KernelBench" / "level1"
    level1.mkdir(parents=True)
    shutil.copy(ROOT / "tasks" / "level1" / "01_relu.py", level1 / "19_ReLU.py")
    (clone / "scripts").mkdir()
    (clone / "scripts" / "run_and_check.py").write_text("def main():\n    inputs = ref.get_inputs()\n")
    solution = (SOLUTIONS / "level1" / "01_relu.py").read_text()
    answers = tmp_path / "answers.jsonl"
    answers.write_text(
        json.dumps({"task_id": "level1/19_ReLU", "sample": 0, "text": f"```python\n{solution}```"})
        + "\n"
        + json.dumps({"task_id": "level1/19_ReLU", "sample": 1, "text": "no code"})
        + "\n"
    )
    out = tmp_path / "out"
    code, _text, err = run_eval(
        capsys,
        "--answers",
        str(answers),
        "--tasks",
        str(clone),
        "--backend",
        "cpu",
        "--out",
        str(out),
        f"verifier.cache_dir={verifier_cache_dir}",
    )
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task_roots"] == [str(clone / "KernelBench")] and summary["failed_loads"] == []
    overall = summary["rows"][-1]
    assert (overall["tasks"], overall["attempts"], overall["passed"]) == (1, 2, 1)
    assert overall["pass_at"] == {"1": 0.5, "2": 1.0}


def test_killed_evaluation_resumes_without_verifying_finished_attempts(tmp_path, capsys):
    """SIGKILL once the first attempt is logged; the rerun verifies only the rest. A private verifier
    cache keeps each compile slow enough that the kill lands mid-way."""
    tasks = task_tree(tmp_path / "tasks", ["level1/02_gelu_tanh.py", "level1/03_silu.py", "level1/06_hardtanh.py"])
    answers = write_answers(tmp_path / "answers.jsonl", tasks, variants=False)
    out = tmp_path / "out"
    args = [
        "eval",
        "--answers",
        str(answers),
        "--tasks",
        str(tasks),
        "--backend",
        "cpu",
        "--out",
        str(out),
        f"verifier.cache_dir={tmp_path / 'cache'}",
        "verifier.max_concurrent_requests=1",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log = out / "attempts.jsonl"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and log.read_text().count("\n") >= 1:
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the evaluation and its sandbox children
        proc.wait()
    before = log.read_text().count("\n")
    assert 1 <= before < 3
    with open(log, "a") as f:
        f.write('{"task_id": "level1/0')  # a line torn by the kill is cut off, not trusted
    code = main(args)
    capsys.readouterr()
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {"attempts": 3, "resumed": before, "verified": 3 - before, "infra": 0, "tasks": 3}
    keys = [(r["task_id"], r["sample"]) for r in rows(out)]
    assert len(keys) == len(set(keys)) == 3
    assert summary["rows"][-1]["passed"] == 3


def test_tiny_checkpoint_over_tasks_writes_every_output(
    tiny_chat_model, tmp_path, capsys, verifier_cache_dir, one_torch_thread
):
    out = tmp_path / "out"
    code, text, err = run_eval(
        capsys,
        "--model",
        str(tiny_chat_model),
        "--tasks",
        "tasks",
        "--backend",
        "cpu",
        "--samples",
        "2",
        "--k",
        "1,2",
        "--max-new-tokens",
        "24",
        "--out",
        str(out),
        f"verifier.cache_dir={verifier_cache_dir}",
    )
    assert code == 0, err
    for name in ("table.md", "summary.json", "attempts.jsonl", "chart.png"):
        assert (out / name).stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary["rows"]] == ["level 1", "level 2", "level 3", "level 4", "Overall"]
    assert summary["sampling"]["temperature"] == 0.7 and summary["sampling"]["top_p"] == 0.95
    assert summary["sampling"]["max_new_tokens"] == 24
    attempts = rows(out)
    assert len(attempts) == 48 and {a["sample"] for a in attempts} == {0, 1}
    assert all(a["finish_reason"] in ("stop", "length") for a in attempts)
    assert f"| {tiny_chat_model.name} |" in text  # the table is printed, one row named after the model


def test_in_run_validation_uses_the_evaluation_code_and_never_forced_candidates(demo_run):
    """The demo trains on forced candidates; its validation samples the policy (launch/stages/eval/ writes it)."""
    from actors.rollout.forced import candidates
    from tasks.loader import discover, to_task

    steps = sorted((demo_run.path / "eval").glob("step-*"))
    assert steps, "the final validation wrote RUN_DIR/eval/step-N/"
    last = steps[-1]
    assert (last / "table.md").read_text().startswith("# Evaluation: step")
    attempts = rows(last)
    tasks = {tf.task_id: to_task(tf, "cpu") for tf in discover(ROOT / "tasks")}
    pool = {text for a in attempts for text in candidates(tasks[a["task_id"]], SOLUTIONS)}
    assert attempts and not any(a["text"] in pool or a["text"].strip("`\n") in pool for a in attempts)
    report = (demo_run.path / "report.md").read_text()
    assert "### By level" in report


def test_on_ray_the_engine_and_verifiers_are_actors(ray_session, tiny_chat_model, tmp_path, capsys, verifier_cache_dir):
    """--ray: a RolloutActor (the engine) and the verifiers run as Ray actors; batches go through
    RolloutActor.evaluate, the in-run validation's method."""
    tasks = task_tree(tmp_path / "tasks", ["level1/01_relu.py", "level2/06_rmsnorm.py"])
    out = tmp_path / "out"
    code, _text, err = run_eval(
        capsys,
        "--model",
        str(tiny_chat_model),
        "--tasks",
        str(tasks),
        "--backend",
        "cpu",
        "--samples",
        "2",
        "--max-new-tokens",
        "16",
        "--ray",
        "--out",
        str(out),
        f"verifier.cache_dir={verifier_cache_dir}",
    )
    assert code == 0, err
    attempts = rows(out)
    assert sorted((a["task_id"], a["sample"]) for a in attempts) == [
        ("level1/01_relu", 0),
        ("level1/01_relu", 1),
        ("level2/06_rmsnorm", 0),
        ("level2/06_rmsnorm", 1),
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["verified"] == 4 and summary["rows"][-1]["attempts"] + summary["counts"]["infra"] == 4


def test_engine_urls_sample_through_a_served_model(
    tiny_chat_model, tmp_path, capsys, verifier_cache_dir, one_torch_thread
):
    """--engine-urls: generation goes to a server speaking the SGLang API (here Kiln's own HTTP server
    in front of the torch engine); --model's tokenizer and chat template pose the prompts."""
    from actors.policy.tokenizer import load_tokenizer
    from actors.rollout.engines import make_engine
    from actors.rollout.http_server import EngineServer
    from configs import ModelConfig, RolloutConfig

    model = ModelConfig(path=str(tiny_chat_model), max_seq_len=4096)
    tokenizer = load_tokenizer(model)
    engine = make_engine(RolloutConfig(device="cpu"), model, index=0, eos_token_ids=tokenizer.stop_ids)
    server = EngineServer(engine, decode=tokenizer.decode)
    server.start()
    tasks = task_tree(tmp_path / "tasks", ["level1/01_relu.py"])
    try:
        code, _, err = run_eval(
            capsys,
            "--model",
            str(tiny_chat_model),
            "--engine-urls",
            server.url,
            "--tasks",
            str(tasks),
            "--backend",
            "cpu",
            "--samples",
            "2",
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "out"),
            f"verifier.cache_dir={verifier_cache_dir}",
        )
        served_tokens = engine.health().tokens
    finally:
        server.stop()
        engine.close()
    assert code == 0, err
    assert served_tokens > 0 and len(rows(tmp_path / "out")) == 2
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["sampling"]["engine"] == "sglang" and server.url in summary["source"]
