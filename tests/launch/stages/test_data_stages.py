"""The data stages end to end on the tiny real-format checkpoint: `kiln rft` over the shipped level-1
tasks in forced-candidate mode writes a deduplicated JSONL; `kiln sft` trains on it (the loss on
assistant tokens falls), exports a directory transformers loads, and resumes. Around them: the loss
mask of a multi-turn example, the deduplication of renamed copies, the one-line answer to a bad data
line, and decontamination."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from actors.policy.chat_data import ChatExample, DataError, parse_example, read_examples
from actors.policy.chat_tokens import tokenize_example
from actors.policy.tokenizer import HFTokenizer, Message
from launch.cli.main import main as kiln_main
from launch.stages.rft.normalise import source_key
from launch.stages.rft.select import Candidate, TaskYield, choose

ROOT = Path(__file__).resolve().parents[3]
RELU = (ROOT / "tasks" / "solutions" / "cpu" / "level1" / "01_relu.py").read_text()
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def renamed_relu() -> str:
    """01_relu with every name it chose changed, in Python and in C++, plus comments and layout."""
    out = RELU
    for old, new in (
        ("relu_forward", "rectify"),
        ("relu_ext", "compiled"),
        (r"\bcpp_source\b", "kernel_code"),
        ("kiln_cpu_l1_relu", "my_extension"),
        (r"\bsrc\b", "input_ptr"),
        (r"\bdst\b", "output_ptr"),
        (r"\bv\b", "value"),
        (r"\bn\b", "count"),
        (r"\bi\b", "idx"),
        (r"\bout\b", "result"),
    ):
        out = re.sub(old, new, out)
    out = out.replace("    x = x.contiguous();", "    // contiguous first\n    x  =  x.contiguous( );")
    out = out.replace(
        "def forward(self, x):\n        return compiled.rectify(x)",
        'def forward(self, tensor):\n        """Apply ReLU."""\n        return compiled.rectify(tensor)',
    )
    assert out.count("rectify") == 3 and "tensor" in out and "input_ptr" in out
    return out


# ------------------------------------------------------------------------------------------ units


def test_renamed_copies_collapse_into_one_entry_and_other_kernels_stay():
    copy = renamed_relu()
    assert source_key(copy) == source_key(RELU)
    leaky = RELU.replace("v > 0.0f ? v : 0.0f", "v > 0.0f ? v : 0.01f * v")
    assert source_key(leaky) != source_key(RELU)
    calls_other = RELU.replace("return relu_ext.relu_forward(x)", "return relu_ext.relu_forward(x.t())")
    assert source_key(calls_other) != source_key(RELU)

    def candidate(code: str, speedup: float | None, order: int) -> Candidate:
        example = ChatExample((Message("user", "task"), Message("assistant", f"```python\n{code}```\n")))
        return Candidate(example, source_key(code), speedup, "first", order)

    row = TaskYield("level1/01_relu")
    kept = choose([candidate(RELU, 1.1, 0), candidate(copy, 1.9, 1), candidate(leaky, None, 2)], 4, row)
    assert (row.distinct, row.kept) == (2, 2)
    assert kept[0].speedup == 1.9 and kept[0].example.messages[-1].content.count("rectify") == 3  # the faster copy
    assert len(choose([candidate(RELU, 1.0, 0), candidate(leaky, 2.0, 1)], 1, TaskYield("t"))) == 1


def test_multi_turn_mask_covers_the_trained_answers_and_their_end_of_turn(tiny_chat_model):
    tok = HFTokenizer(str(tiny_chat_model))
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "Write relu."},
        {"role": "assistant", "content": "```python\nbroken(\n```", "train": False},
        {"role": "user", "content": "The verifier rejected this answer. Fix it."},
        {"role": "assistant", "content": "```python\nfixed = 1\n```"},
        {"role": "user", "content": "Make it faster."},
        {"role": "assistant", "content": "```python\nfaster = 2\n```"},
    ]
    example = parse_example({"messages": messages})
    sequences = tokenize_example(example, tok)
    assert len(sequences) == 2  # one per trained answer; the failed one is context only
    end = tok.end_of_turn_id
    for seq, i in zip(sequences, (4, 6), strict=True):
        # the prompt is exactly what the rollout renders for that turn; the loss is on the answer only
        assert list(seq.prompt) == tok.render([Message(**{k: m[k] for k in ("role", "content")}) for m in messages[:i]])
        trained = [t for t, on in zip(seq.ids, seq.loss_mask, strict=True) if on]
        assert trained[-1] == end and tok.decode(trained[:-1]) == messages[i]["content"]
    assert "broken(" in tok.decode(sequences[0].prompt) and "fixed = 1" in tok.decode(sequences[1].prompt)


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ('{"messages": [{"role": "user", "content": "q"}]}', "the last message must be the assistant's answer"),
        ('{"messages": [{"role": "robot", "content": "q"}]}', "role must be one of"),
        (
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "train": false}]}',
            "nothing to learn",
        ),
        ('{"messages": [], "extra": 1}', "unknown key 'extra'"),
    ],
)
def test_a_bad_data_line_is_one_line_naming_file_and_line(line, message, tmp_path, capsys, tiny_chat_model):
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    data = tmp_path / "data.jsonl"
    data.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(DataError, match=re.escape(f"{data}:3: ") + ".*" + re.escape(message)):
        list(read_examples(data))
    status = kiln_main(["sft", "--model", str(tiny_chat_model), "--data", str(data), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith(f"kiln sft: {data}:3: "), err


def test_sft_drops_examples_of_evaluation_tasks_and_counts_them(tmp_path, tiny_chat_model):
    from configs import ReplayConfig
    from launch.stages.decontam import eval_tasks
    from launch.stages.sft.data import load_sft_data

    kernelbench = tmp_path / "kb" / "level1"
    kernelbench.mkdir(parents=True)
    reference = (ROOT / "tasks" / "level1" / "01_relu.py").read_text()
    (kernelbench / "19_ReLU.py").write_text("# a KernelBench copy\n" + reference)
    replay = ReplayConfig(tasks=str(ROOT / "tasks"))
    val_id = next(tf.task_id for tf in eval_tasks(replay, None, [], trace=False).val_files)

    def line(task_id: str, shown: str) -> str:
        return json.dumps(
            {
                "task_id": task_id,
                "messages": [
                    {"role": "user", "content": f"Reference:\n```python\n{shown}```\n"},
                    {"role": "assistant", "content": "```python\nx = 1\n```"},
                ],
            }
        )

    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join([line(val_id, "pass\n"), line("mine/relu_copy", reference), line("mine/other", "y = 2\n")]) + "\n"
    )
    evaluation = eval_tasks(replay, None, [kernelbench.parent], trace=False)
    loaded = load_sft_data(
        data, HFTokenizer(str(tiny_chat_model)), evaluation, eval_fraction=0.0, seed=0, max_seq_len=4096
    )
    assert loaded.examples == 3 and loaded.train_examples == 1
    assert evaluation.dropped == Counter({"validation split": 1, "evaluation task (source)": 1})


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def rft_run(tmp_path_factory, tiny_chat_model, verifier_cache_dir):
    out = tmp_path_factory.mktemp("rft") / "rft.jsonl"
    status = kiln_main(
        [
            "rft",
            "--model",
            str(tiny_chat_model),
            "--tasks",
            str(ROOT / "tasks" / "level1"),
            "--samples",
            "3",
            "--max-per-task",
            "2",
            "--keep-repairs",
            "--forced",
            str(ROOT / "tasks" / "solutions" / "cpu"),
            "--backend",
            "cpu",
            "--out",
            str(out),
            "model.max_seq_len=4096",
            "rollout.max_new_tokens=2560",
            "rollout.max_turns=2",
            f"verifier.cache_dir={verifier_cache_dir}",
            "verifier.compile_baseline=never",
        ]
    )
    return status, out


def test_rft_writes_a_deduplicated_jsonl_with_a_yield_table(rft_run):
    status, out = rft_run
    assert status == 0
    examples = list(read_examples(out))
    summary = json.loads(Path(f"{out}.yield.json").read_text())
    rows = summary["rows"]
    assert len(rows) == 6 and sum(r["samples"] for r in rows) == 18
    assert len(examples) == summary["kept"] == sum(r["kept"] for r in rows) > 0
    assert all(r["kept"] <= min(2, r["distinct"]) for r in rows)
    per_task = Counter(e.task_id for e in examples)
    assert all(n <= 2 for n in per_task.values())
    keys = [(e.task_id, tuple(source_key(m.content) for m in e.messages if m.role == "assistant")) for e in examples]
    assert len(set(keys)) == len(keys)  # no two entries of a task are one implementation
    for e in examples:  # every kept answer passed the verifier; a repair dialogue trains only its last answer
        assert e.meta["kind"] in ("first", "repair") and e.messages[-1].role == "assistant"
        assert e.trained(len(e.messages) - 1)
        assert all(not e.trained(i) for i, m in enumerate(e.messages[:-1]) if m.role == "assistant")


@pytest.fixture(scope="module")
def sft_run(rft_run, tmp_path_factory, tiny_chat_model):
    _, data = rft_run
    out = tmp_path_factory.mktemp("sft") / "out"
    argv = [
        "sft",
        "--model",
        str(tiny_chat_model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--epochs",
        "4",
        "--lr",
        "3e-3",
        "--batch-tokens",
        "6144",
        "--eval-fraction",
        "0",
        "--export-every",
        "2",
        "model.max_seq_len=4096",
        "logging.tensorboard=false",
    ]
    assert kiln_main(argv) == 0
    return out, argv


def test_sft_on_the_rft_output_lowers_the_assistant_loss_and_exports(sft_run):
    out, _ = sft_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/loss"] for r in rows]
    assert len(losses) >= 4 and losses[-1] < losses[0] - 0.3, losses
    assert (out / "report.md").read_text().count("training loss") == 1 and (out / "plots" / "loss.png").is_file()
    assert min(p.name for p in (out / "exports").iterdir()) == "step-000002"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert tokenizer.chat_template and model.config.vocab_size == len(tokenizer)
    assert (out / "final" / "generation_config.json").is_file()


def test_kiln_eval_runs_on_the_sft_export(sft_run, tmp_path, capsys, verifier_cache_dir):
    """The pipeline's last stage: the SFT export is a model `kiln eval` samples and verifies."""
    out, _ = sft_run
    ev = tmp_path / "eval"
    code = kiln_main(
        [
            "eval",
            "--model",
            str(out / "final"),
            "--tasks",
            str(ROOT / "tasks" / "level1"),
            "--backend",
            "cpu",
            "--samples",
            "1",
            "--k",
            "1",
            "--max-new-tokens",
            "24",
            "--out",
            str(ev),
            f"verifier.cache_dir={verifier_cache_dir}",
        ]
    )
    assert code == 0, capsys.readouterr().err
    summary = json.loads((ev / "summary.json").read_text())
    assert [r["label"] for r in summary["rows"]] == ["level 1", "Overall"]
    attempts = [json.loads(line) for line in (ev / "attempts.jsonl").read_text().splitlines()]
    assert len(attempts) == len(list((ROOT / "tasks" / "level1").glob("*.py")))


def test_sft_resumes_from_its_output_directory(sft_run, capsys):
    out, argv = sft_run
    before = (out / "metrics.jsonl").read_text()
    assert kiln_main(argv) == 0
    printed = capsys.readouterr().out
    assert "resumed from step" in printed and "no step left to take" in printed
    assert (out / "metrics.jsonl").read_text() == before
    changed = [a if a != "4" else "5" for a in argv]  # --epochs 5: another plan of batches
    assert kiln_main(changed) == 2
    assert "trained with other settings (epochs=4)" in capsys.readouterr().err


def test_the_warm_start_builds_its_batches_with_the_sft_code(tiny_chat_model):
    """`warm_start.steps` trains on the shipped solutions as chat examples through the same tokenizing
    and packing as `kiln sft`: each solution one sequence, its prompt the task's opening as the rollout
    renders it, its loss on the fenced solution and the end-of-turn token."""
    from actors.learner.warm_start import solution_example, solution_pairs, warm_start_batches
    from actors.policy.prompts import opening
    from configs import ModelConfig, WarmStartConfig
    from tasks.loader import load_tasks

    tasks = load_tasks(ROOT / "tasks" / "level1", "cpu")
    solutions = ROOT / "tasks" / "solutions" / "cpu"
    batches, pairs = warm_start_batches(
        tasks,
        WarmStartConfig(solutions=str(solutions), batch_tokens=4096),
        ModelConfig(path=str(tiny_chat_model), max_seq_len=4096),
    )
    assert pairs == 6 and sum(len(b.cu_seqlens) - 1 for b in batches) == 6
    tok = HFTokenizer(str(tiny_chat_model))
    task, solution = solution_pairs(tasks, solutions)[0]
    (seq,) = tokenize_example(solution_example(task, solution), tok)
    assert list(seq.prompt) == tok.render(opening(task))
    found = [
        b
        for b in batches
        for s, e in zip(b.cu_seqlens[:-1], b.cu_seqlens[1:], strict=False)
        if list(b.tokens[s:e]) == seq.ids and list(b.loss_mask[s:e]) == seq.loss_mask
    ]
    assert len(found) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_sft_on_the_gpu_lowers_the_loss_and_exports(backend, tmp_path, tiny_chat_model, capsys):
    """`kiln sft --backend B` on CUDA (the megatron backend runs in this process as one rank): the
    assistant-token loss falls over the shipped level-1 solutions and the export loads."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from actors.learner.warm_start import solution_example, solution_pairs
    from actors.policy.chat_data import write_examples
    from tasks.loader import load_tasks

    pairs = solution_pairs(load_tasks(ROOT / "tasks" / "level1", "cuda"), ROOT / "tasks" / "solutions" / "cuda")
    data = write_examples(tmp_path / "sol.jsonl", [solution_example(t, s) for t, s in pairs])
    out = tmp_path / "out"
    assert (
        kiln_main(
            [
                "sft",
                "--model",
                str(tiny_chat_model),
                "--data",
                str(data),
                "--out",
                str(out),
                "--backend",
                backend,
                "--epochs",
                "6",
                "--lr",
                "3e-3",
                "--batch-tokens",
                "8192",
                "--eval-fraction",
                "0",
                "learner.device=cuda",
                "model.max_seq_len=4096",
                "logging.tensorboard=false",
            ]
        )
        == 0
    )
    print(capsys.readouterr().out)
    losses = [json.loads(line)["sft/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] - 0.3, losses

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final").config.vocab_size > 0
