"""Exports a user can serve: RUN_DIR/final/ and `learner.export_every`'s exports load with
transformers' Auto classes, carry the tokenizer, chat template and a generation config with the
rollout's settings, and give the learner's logprobs; `kiln export` turns any checkpoint into one."""

from __future__ import annotations

import json

import numpy as np
import torch

from actors.learner.algorithm import Trainer
from actors.learner.checkpoint import read_latest
from actors.learner.torch_backend import TorchBackend
from actors.policy.prompts import opening
from actors.policy.tokenizer import HFTokenizer
from launch.cli.main import main
from protocols import TrainBatch
from tasks.loader import load_tasks


def learner_logprobs(cfg, state, prompt: list[int], response: list[int], temperature: float) -> np.ndarray:
    """log softmax(logits / T) of `response` after `prompt`, computed by the learner's own code on the
    checkpoint's weights."""
    backend = TorchBackend(cfg.model, cfg.learner, device="cpu")
    backend.load_checkpoint(state)
    tokens = np.asarray(prompt + response, dtype=np.int64)
    n = len(tokens)
    batch = TrainBatch(
        version=0,
        episode_ids=["e"],
        tokens=tokens,
        cu_seqlens=np.asarray([0, n], dtype=np.int64),
        loss_mask=np.asarray([False] * len(prompt) + [True] * len(response)),
        behaviour_logprobs=np.zeros(n, np.float32),
        advantages=np.zeros(1, np.float32),
        versions=np.full(n, -1, np.int64),
    )
    lp = Trainer(backend, cfg.algo, temperature=temperature).logprobs(batch, temperature)
    return np.asarray(lp, dtype=np.float64).reshape(-1)[-len(response) :]


def test_the_final_export_loads_with_auto_classes_and_gives_the_learners_logprobs(demo_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    final, cfg = demo_run.path / "final", demo_run.cfg
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in final.iterdir())  # readable by whoever serves it
    tok = AutoTokenizer.from_pretrained(final, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True, dtype=torch.float32).eval()
    gen = GenerationConfig.from_pretrained(final)
    end_of_text, end_of_turn = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert sorted(gen.eos_token_id) == sorted([end_of_text, end_of_turn])  # stops where a rollout stopped
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.max_new_tokens) == (
        True,
        cfg.rollout.temperature,
        cfg.rollout.top_p,
        cfg.rollout.max_new_tokens,
    )
    # the exported template renders the rollout's prompt, token for token
    task = load_tasks("tasks", "cpu")[0]
    messages = [m.as_template_dict() for m in opening(task)]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    prompt = tok.encode(rendered, add_special_tokens=False)
    assert prompt == HFTokenizer(str(cfg.model.path)).render(opening(task))
    response = tok.encode("```python\nclass ModelNew:\n    pass\n```", add_special_tokens=False) + [end_of_turn]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
    T = cfg.rollout.temperature
    served = torch.log_softmax(logits / T, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()
    state, meta = read_latest(demo_run.path)
    assert (
        meta.step == cfg.algo.total_steps + 2
    )  # the resumed run's last step (2 past the first run), which final/ holds
    np.testing.assert_allclose(served, learner_logprobs(cfg, state, prompt, response, T), atol=1e-5)


def test_kiln_export_turns_a_checkpoint_into_a_servable_directory(demo_run, tmp_path, capsys):
    out = tmp_path / "step2"
    assert main(["export", str(demo_run.path), "--step", "2", "--out", str(out)]) == 0
    assert f"exported step 2 (weight version 2) to {out}" in capsys.readouterr().out
    during = demo_run.path / "exports" / "step-000002"  # what learner.export_every wrote at step 2
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in during.iterdir())
    assert {"tokenizer.json", "generation_config.json", "model.safetensors", "config.json"} <= {
        p.name for p in out.iterdir()
    }
    from safetensors.torch import load_file

    mine, theirs = load_file(out / "model.safetensors"), load_file(during / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (during / "generation_config.json").read_text()
    )
    # one line and exit status 2 for each mistake (step 0: the warm start's checkpoint)
    for argv, message in (
        (["--step", "99"], "has no checkpoint at step 99 (steps with one: 0, 1, 2, "),
        (["--step", "2", "--out", str(out)], f"{out} exists"),
    ):
        assert main(["export", str(demo_run.path), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert main(["export", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"kiln: {tmp_path} is not a Kiln run directory (no config.yaml)\n"


def test_export_every_writes_servable_exports_during_the_run(demo_run):
    exports = sorted(p.name for p in (demo_run.path / "exports").iterdir() if not p.name.startswith("."))
    assert "step-000002" in exports  # learner.export_every=2 during the first session
    assert not any(p.name.startswith(".") for p in (demo_run.path / "exports").iterdir())  # no staging left
