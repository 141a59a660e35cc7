"""Start-up checks (launch/driver/checks.py) and the one-line errors of the CLI: each bad input a new user
met is one line on stderr and a non-zero exit, before anything starts."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from configs import load_config
from launch.cli.main import main
from launch.driver.checks import Finding, on_cluster
from launch.driver.plan import plan

ROOT = Path(__file__).resolve().parents[3]
TEXT_MATCH = str(ROOT / "configs" / "examples" / "text_match.yaml")  # fast to check: no compiler, no kernels


def run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def train_args(tmp_path, *overrides: str, dry_run: bool = False, config: str = TEXT_MATCH) -> list[str]:
    return [
        "train",
        "--config",
        config,
        *(["--dry-run"] if dry_run else []),
        f"logging.root={tmp_path / 'runs'}",
        *overrides,
    ]


def test_an_absent_model_path_plans_with_a_warning_and_refuses_to_train(tmp_path, capsys):
    code, out, err = run(capsys, *train_args(tmp_path, "model.path=/no/such/checkpoint", dry_run=True))
    assert code == 0 and err == [
        (
            "kiln: warning: model.path=/no/such/checkpoint does not exist on this machine; "
            "the plan uses the model section's sizes"
        )
    ]
    assert "placement plan" in out and "from model section" in out and "kiln: tasks: 300 from" in out
    code, out, err = run(capsys, *train_args(tmp_path, "model.path=/no/such/checkpoint"))
    assert code == 2 and err == ["kiln: error: model.path=/no/such/checkpoint: no such directory"]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing started


def test_a_hub_id_is_refused_unless_downloads_are_allowed(tmp_path, capsys):
    code, _, err = run(capsys, *train_args(tmp_path, "model.path=Qwen/Qwen3-0.6B", dry_run=True))
    assert code == 2 and len(err) == 1
    assert (
        err[0].startswith(
            "kiln: error: model.path=Qwen/Qwen3-0.6B is not a directory here and looks like a Hugging Face hub id"
        )
        and "model.allow_download=true" in err[0]
    )


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path, capsys, tiny_chat_model):
    (tmp_path / "ckpt").mkdir()
    code, _, err = run(capsys, *train_args(tmp_path, f"model.path={tmp_path / 'ckpt'}", dry_run=True))
    assert code == 2 and err == [
        f"kiln: error: model.path={tmp_path / 'ckpt'} holds no config.json: not an HF checkpoint directory"
    ]
    # a real checkpoint passes; the plan reads its sizes
    code, out, err = run(capsys, *train_args(tmp_path, f"model.path={tiny_chat_model}", dry_run=True))
    assert code == 0 and err == [] and str(tiny_chat_model / "config.json") in out


def test_broken_tasks_are_listed_and_an_empty_validation_split_is_warned(tmp_path, capsys):
    tasks = tmp_path / "tasks" / "level1"
    tasks.mkdir(parents=True)
    (tasks / "ok.py").write_text((ROOT / "tasks" / "level1" / "01_relu.py").read_text())
    (tasks / "typo.py").write_text("class Model(nn.Module:\n    pass\ndef get_inputs(): return []\n")
    (tasks / "half.py").write_text("class Model: pass\n")
    code, out, err = run(
        capsys,
        *train_args(
            tmp_path,
            f"replay.tasks={tmp_path / 'tasks'}",
            "replay.val_fraction=0",
            "model.path=null",
            dry_run=True,
            config=str(ROOT / "configs" / "default.yaml"),
        ),
    )
    assert code == 2 and len(err) == 3
    assert err[0] == (
        f"kiln: error: replay.tasks: broken task {tasks / 'half.py'}: defines no get_inputs(), "
        "get_init_inputs() at module level"
    )
    # (the parser's wording differs between Python versions; the line number does not)
    assert err[1].startswith(f"kiln: error: replay.tasks: broken task {tasks / 'typo.py'}: does not parse: ")
    assert err[1].endswith("(line 1)")
    assert err[2] == (
        "kiln: warning: the validation split is empty (replay.val_fraction=0.0): evaluations will "
        "have nothing to measure"
    )
    assert "kiln: tasks: 1 from" in out and "(level1: 1); 1 train, 0 validation" in out


def test_an_unwritable_run_root_and_a_reward_actor_that_cannot_be_built(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, _, err = run(
        capsys, "train", "--config", TEXT_MATCH, "--dry-run", f"logging.root={tmp_path / 'file' / 'runs'}"
    )
    assert code == 2 and err == [
        f"kiln: error: logging.root={tmp_path / 'file' / 'runs'} is not writable: {tmp_path / 'file'} is a file"
    ]
    code, _, err = run(capsys, *train_args(tmp_path, "verifier.reward_actor_args={partial_credit: 5}", dry_run=True))
    assert code == 2 and err == [
        (
            "kiln: error: verifier.reward_actor=actors.verifier.examples.TextMatchReward with reward_actor_args="
            "{'partial_credit': 5}: constructing TextMatchReward raised ValueError: partial_credit must lie in [0, 2), "
            "got 5"
        )
    ]


def test_a_binary_config_file_is_one_line(tmp_path, capsys):
    config = tmp_path / "model.safetensors"
    config.write_bytes(b"\x89\x00\xff\xfe binary")
    code, _, err = run(capsys, "config", "--config", str(config))
    assert code == 2 and err == [
        f"kiln: config error: {config}: not a text file (byte 0 is not UTF-8); a config is a YAML file"
    ]


def test_a_closed_pipe_is_one_line_and_exit_141():
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "train", "--dry-run", "--config", TEXT_MATCH],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # `| head` that already left
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert err.splitlines() == ["kiln: output closed early (broken pipe); the rest was not written"], err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without CUDA")
def test_verify_with_the_cuda_backend_on_a_machine_without_cuda(capsys):
    relu = str(ROOT / "tasks" / "level1" / "01_relu.py")
    code, _, err = run(capsys, "verify", "--reference", relu, "--candidate", relu, "--backend", "cuda")
    assert code == 2 and err == [
        (
            "kiln verify: backend cuda needs a CUDA device and none is visible on this machine "
            "(torch.cuda.is_available() is False); use --backend cpu"
        )
    ]


def test_verify_names_a_reference_whose_get_inputs_raises(tmp_path, capsys):
    ref = tmp_path / "ref.py"
    ref.write_text(
        textwrap.dedent("""\
        import torch
        class Model(torch.nn.Module):
            def forward(self, x):
                return torch.relu(x)
        def get_inputs():
            raise RuntimeError("the data set is not mounted")
        def get_init_inputs():
            return []
        """)
    )
    candidate = ROOT / "tasks" / "solutions" / "cpu" / "level1" / "01_relu.py"
    code, _, err = run(capsys, "verify", "--reference", str(ref), "--candidate", str(candidate), "--backend", "cpu")
    assert code == 2 and err == [
        f"kiln verify: the reference {ref} is broken: get_inputs() raised RuntimeError: the data set is not mounted"
    ]


def test_verify_lists_a_syntax_broken_task_instead_of_dropping_it(tmp_path, capsys):
    level = tmp_path / "level1"
    level.mkdir()
    (level / "01_relu.py").write_text((ROOT / "tasks" / "level1" / "01_relu.py").read_text())
    (level / "02_broken.py").write_text("import torch\nclass Model(torch.nn.Module)\n    pass\n")
    code, _, err = run(
        capsys,
        "verify",
        "--tasks",
        str(tmp_path),
        "--solutions",
        str(ROOT / "tasks" / "solutions" / "cpu"),
        "--backend",
        "cpu",
    )
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        f"kiln verify: 1 broken task file in {tmp_path}: {level / '02_broken.py'}: does not parse: "
    ) and err[0].endswith("(line 2)")


def test_on_a_ray_cluster_each_component_is_checked_where_it_runs(ray_session):
    cfg = load_config(TEXT_MATCH, ["model.path=/only/on/the/gpu/nodes", "cluster.address=auto"])
    findings = on_cluster(cfg, plan(cfg, check_fit=False), ray_options=lambda slot, prefer_node: {})
    # the learner's and the rollout's node both lack the checkpoint: reported once, named by component
    assert findings == [
        Finding(
            "note",
            "replay: tasks: 300 from actors.buffer.examples.TextMatchTasks (text_match: 300); 275 train, 25 validation",
        ),
        Finding("error", "learner: model.path=/only/on/the/gpu/nodes: no such directory"),
    ]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without CUDA")
def test_a_gpu_preset_plans_anywhere_but_runs_only_where_its_verifier_can(tmp_path, capsys):
    preset = str(ROOT / "configs" / "eight_gpu.yaml")
    code, out, err = run(capsys, *train_args(tmp_path, dry_run=True, config=preset))
    assert code == 0 and "engines" in out
    assert err == [
        (
            "kiln: warning: verifier.backend=cuda: no CUDA device is visible on this machine; the verifiers "
            "must run where there is one"
        )
    ]
    code, _, err = run(capsys, *train_args(tmp_path, config=preset))
    assert code == 2 and err == [
        (
            "kiln: error: verifier.backend=cuda is not available here: constructing KernelVerifier "
            "raised RuntimeError: verifier.backend=cuda but no CUDA device is visible to this process"
        )
    ]


def test_a_staleness_window_smaller_than_the_engines_rows_is_warned(tmp_path, capsys):
    from launch.driver.checks import check_window

    # issue 35's loop: η = 1, B = 4, G = 4 against one engine of 64 rows; a two-GPU loop decoded 4.8
    # rows a step under it, with 32 attempts in flight at most and most of them at the verifier
    cfg = load_config(ROOT / "configs" / "two_gpu.yaml", ["algo.group_size=4"])
    (finding,) = check_window(cfg.algo, cfg.rollout)
    assert finding.level == "warning" and "(η + 1)·B·G = 32 attempts" in finding.text and "64 rows" in finding.text
    assert "50%" in finding.text
    # a window of at least the engines' rows, every shipped preset, and an SGLang server (which sizes
    # its own batch) pass without one
    assert check_window(dataclasses.replace(cfg.algo, max_staleness=3), cfg.rollout) == []
    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        preset_cfg = load_config(preset)
        assert check_window(preset_cfg.algo, preset_cfg.rollout) == [], preset.name
    assert check_window(cfg.algo, dataclasses.replace(cfg.rollout, engine="sglang")) == []
    # the dry run prints it, and plans anyway
    code, _, err = run(capsys, *train_args(tmp_path, "algo.batch_groups=2", "algo.max_staleness=0", dry_run=True))
    assert code == 0 and any("kiln: warning: the staleness window admits at most" in line for line in err), err
