"""`make demo`'s configuration (configs/default.yaml) through `kiln train`, in-process, on a checkpoint in
the real HF format (the session's `demo_run`): the road a user's checkpoint takes. The kernel
verifier does real compiles, runs and legality checks on the forced candidates; the supervised warm
start on the shipped solutions comes first; prompts are chat conversations rendered by the
checkpoint's template, and a failed attempt's repair turn continues the dialogue; the run is
evaluated, exported, and resumed.
"""

from __future__ import annotations

import re

from launch.metrics import read_metrics


def test_demo_warm_starts_then_trains_on_verified_kernels(demo_run):
    rows = demo_run.rows
    sft = next(r for r in rows if "sft/first_loss" in r)
    assert sft["sft/steps"] == 3 and sft["sft/final_loss"] < sft["sft/first_loss"]
    steps = [r for r in rows if "train/loss" in r]
    assert [int(r["weights/version"]) for r in steps] == [1, 2]
    # Step 1 trains on samples the engine made with version 0. Had the engine served the weights from
    # before the warm start, their behaviour logprobs would be off from the learner's by the SFT's change.
    log_rho = steps[0]["train/abs_log_rho_mean"]
    assert log_rho < 1e-3, log_rho
    outcomes = {k for r in rows for k, v in r.items() if k.startswith("verifier/") and v}
    # real verifier work on every kind of candidate: compile errors, wrong results, fallbacks, passes;
    # and no attempt failed through the system (a repair prompt too long for the context once did)
    assert {"verifier/compile", "verifier/correctness", "verifier/legality", "verifier/done"} <= outcomes, outcomes
    assert "verifier/error/infra" not in outcomes, outcomes
    assert any("eval/pass@1" in r for r in rows)  # the final evaluation on the validation split
    ep = demo_run.summary["episodes"]
    assert ep["invariant_ok"] and ep["trained"] > 0
    assert (demo_run.path / "final" / "config.json").exists()


def test_prompts_are_chat_dialogues_and_a_repair_turn_shows_the_earlier_attempt(demo_run):
    dumps = "\n".join(p.read_text() for p in sorted((demo_run.path / "episodes").glob("step-*.txt")))
    # through the chat template (the dump indents every line by four spaces)
    assert "    <|im_start|>system\n    You write fast native kernels" in dumps
    assert "<|im_end|>\n    <|im_start|>user\n    Task " in dumps
    repairs = re.findall(r"turn 1 \(repair\).*?\n(prompt \(its first .*?)\nresponse:", dumps, re.S)
    assert repairs, "a failed first attempt got a repair turn"
    for prompt in repairs:
        lines = [line[4:] for line in prompt.splitlines()[1:]]  # un-indent the dump
        text = "\n".join(lines)
        # the earlier attempt as the model's own turn, then the verifier's feedback as the user's
        assert text.startswith("<|im_start|>assistant\n") and "<|im_start|>user\nThe verifier rejected" in text
        attempt = text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
        assert attempt.count("```python") <= 1 and "```python\n```python" not in text  # no fence inside a fence


def test_resume_continues_the_run_above_its_versions(demo_run):
    versions = [int(r["weights/version"]) for r in read_metrics(demo_run.path) if "train/loss" in r]
    assert versions[:2] == [1, 2] and versions[2:] == [4], versions  # version 3 = the restore's announcement
    resumed = demo_run.resumed_summary
    assert resumed["learner"]["restored_from"] == 2 and resumed["learner"]["step"] == 3
    assert resumed["episodes"]["invariant_ok"]
    assert resumed["episodes"]["trained"] > demo_run.summary["episodes"]["trained"]
