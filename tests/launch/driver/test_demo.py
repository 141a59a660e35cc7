"""`make demo`'s configuration (configs/default.yaml) through `kiln train`, in-process, in its CI-sized
form on a checkpoint in the real HF format (the session's `demo_run`): the road a user's checkpoint
takes. The kernel verifier does real compiles, runs and legality checks on the forced candidates; the
supervised warm start on the shipped solutions comes first; prompts are chat conversations rendered by
the checkpoint's template, and a failed attempt's repair turn continues the dialogue; every mechanism
of the algorithm acts, and the report counts each and points at an episode that shows it; the run is
evaluated, exported, and resumed.
"""

from __future__ import annotations

import re

from launch.observe import mechanisms
from launch.observe.episode_dump import read_index
from launch.observe.metrics import read_metrics


def test_demo_warm_starts_then_trains_on_verified_kernels(demo_run):
    rows = demo_run.rows
    sft = next(r for r in rows if "sft/first_loss" in r)
    assert sft["sft/steps"] == 3 and sft["sft/final_loss"] < sft["sft/first_loss"]
    steps = [r for r in rows if "train/loss" in r]
    total = demo_run.cfg.algo.total_steps
    assert [int(r["weights/version"]) for r in steps] == list(range(1, total + 1))
    # Step 1 trains on samples the engine made with version 0. Had the engine served the weights from
    # before the warm start, their behaviour logprobs would be off from the learner's by the SFT's change.
    log_rho = steps[0]["train/abs_log_rho_mean"]
    assert log_rho < 1e-3, log_rho
    # no attempt failed through the system (a repair prompt too long for the context once did)
    assert not any(r.get("verifier/error/infra") for r in rows)
    assert any("eval/pass@1" in r for r in rows)  # the final evaluation on the validation split
    ep = demo_run.summary["episodes"]
    assert ep["invariant_ok"] and ep["trained"] > 0
    assert demo_run.summary["id_check"]["ok"], demo_run.summary["id_check"]  # the witnesses agree (id_check.py)
    assert (demo_run.path / "final" / "config.json").exists()


def test_every_mechanism_of_the_demo_acted_and_the_report_points_at_an_episode_showing_it(demo_run):
    counts = mechanisms.counts(demo_run.rows)
    index = read_index(demo_run.path)  # both sessions' dumps
    for m in mechanisms.DEMO_MECHANISMS:
        assert counts[m.name] > 0, (m.name, counts)
        # The first session's report points at the first session's first dump of it. A mechanism that
        # first acted in that session's last step, with episodes that reached the driver after its
        # last dump, has none there (the report says so); the resumed session then shows it.
        shown = next((r for r in demo_run.index if m.tag in r["tags"]), None)
        first = shown or next((r for r in index if m.tag in r["tags"]), None)
        assert first is not None, m.tag
        dump = (demo_run.path / "episodes" / first["file"]).read_text()
        assert f"episode {first['episode_id']} " in dump
        cell = m.name.replace("|", "\\|")  # as the Markdown table escapes it
        row = next(line for line in demo_run.report.splitlines() if line.startswith(f"| {cell} |"))
        if shown is not None:
            assert f"[{first['file']}](episodes/{first['file']})" in row and f"`{first['episode_id']}`" in row, row
        else:
            assert "no dump (the episode was not held" in row, row
    # the report's files: report.md and report.html side by side, every plot a PNG the report shows
    page = (demo_run.path / "report.html").read_text()
    assert "<h2>Mechanisms</h2>" in page and "data:image/png;base64," in page
    plots = sorted(p.name for p in (demo_run.path / "plots").glob("*.png"))
    assert plots == [
        "corrections.png",
        "policy.png",
        "progress.png",
        "reward.png",
        "staleness.png",
        "throughput.png",
        "timeline.png",
        "training.png",
        "verifier.png",
    ], plots
    for name in plots:
        assert f"(plots/{name})" in demo_run.report and (demo_run.path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    assert "Not recorded" not in demo_run.report
    wall = re.search(r"\| wall time \(this session, as `kiln train` printed it\) \| (\d+) s \|", demo_run.report)
    assert wall and int(wall.group(1)) == round(demo_run.summary["wall_s"])


def test_prompts_are_chat_dialogues_and_a_repair_turn_shows_the_earlier_attempt(demo_run):
    dumps = "\n".join(p.read_text() for p in sorted((demo_run.path / "episodes").glob("step-*.txt")))
    # through the chat template (the dump indents every line by four spaces)
    assert "    <|im_start|>system\n    You write fast native kernels" in dumps
    assert "<|im_end|>\n    <|im_start|>user\n    Task " in dumps
    repairs = re.findall(r"turn 1 \(repair\).*?\n(prompt \(its first .*?)\nresponse:", dumps, re.DOTALL)
    assert repairs, "a failed first attempt got a repair turn"
    for prompt in repairs:
        lines = [line[4:] for line in prompt.splitlines()[1:]]  # un-indent the dump
        text = "\n".join(lines)
        # the earlier attempt as the model's own turn, then the verifier's feedback as the user's
        assert text.startswith("<|im_start|>assistant\n") and "<|im_start|>user\nThe verifier rejected" in text
        attempt = text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
        assert attempt.count("```python") <= 1 and "```python\n```python" not in text  # no fence inside a fence
    # each dumped episode ends with its reward terms and what happened to it
    assert dumps.count("PrimeEcho R = α·s_first + (1-α)·max s + b_early") == dumps.count("\nepisode ")
    assert "advantage " in dumps and "what happened to it: trained at step" in dumps


def test_resume_continues_the_run_above_its_versions(demo_run):
    total = demo_run.cfg.algo.total_steps
    versions = [int(r["weights/version"]) for r in read_metrics(demo_run.path) if "train/loss" in r]
    # the final checkpoint is the newest state: the resumed learner continues at its version
    assert versions[:total] == list(range(1, total + 1)) and versions[total:] == [total + 1, total + 2], versions
    resumed = demo_run.resumed_summary
    assert resumed["learner"]["restored_from"] == total and resumed["learner"]["step"] == total + 2
    assert resumed["episodes"]["invariant_ok"]
    assert resumed["episodes"]["trained"] > demo_run.summary["episodes"]["trained"]
