"""The repair-text workload of `kiln ablate` and configs/examples/repair_text.yaml: the reward's rules
by hand, the task families, and the plug-ins loaded through the config's dotted paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.base import load_plugin
from actors.buffer.repair_text import RepairTextTasks
from actors.buffer.task_source import TaskSource
from actors.verifier.interface import RewardActor
from actors.verifier.repair_text import judge
from configs import load_config
from protocols import Task, VerifyRequest

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "examples" / "repair_text.yaml"


def v(answer, text):
    return judge(answer, text, partial_credit=1.5, letter_credit=0.25)


def test_a_clean_pass_scores_1_and_is_not_slow():
    assert v("cba", "cba") == {"passed": True, "q": 1.0, "score": 1.0, "speedup": 1.0, "feedback": "Correct."}
    assert v("c", "  c\n")["speedup"] == 1.0  # surrounding whitespace is not extra output


def test_extra_output_passes_slowly():
    got = v("cba", "cXbay")  # letters read: c, b, a; 5 characters written
    assert got["passed"] and got["speedup"] == pytest.approx(3 / 5) and got["score"] == pytest.approx(0.8)
    assert got["feedback"] == "Correct, but slow: 2 extra characters. Write the answer alone."


def test_failures_name_positions_never_letters():
    got = v("cba", "zbq")
    assert not got["passed"] and got["q"] == pytest.approx(1 / 3)
    assert got["score"] == pytest.approx(-1 + 1.5 * (1 + 0.25 * 2) / 3)
    assert got["feedback"] == "Wrong: letters 1 and 3 are wrong."
    got = v("cba", "c!")
    assert got["feedback"] == "Wrong: 2 letters are missing." and got["score"] == pytest.approx(-0.5)
    assert v("abc", "\x01")["score"] == -1.0
    for text in ("zzz", "a", "abd"):  # the right letters never appear in the feedback
        assert "cba" not in v("cba", text)["feedback"]


def test_every_failure_scores_under_every_pass():
    worst_pass = v("abc", "abc" + "x" * 1000)["score"]
    best_failure = v("abcdefgh", "abcdefgz")["score"]
    assert best_failure < 0.5 < worst_pass


def test_task_families():
    tasks = {t.task_id: t.payload for t in RepairTextTasks(None, "cpu").tasks()}
    assert len(tasks) == 400
    some = next(k for k in tasks if k.startswith("repair_text/sort/"))
    word = some.rsplit("/", 1)[1]
    assert tasks[some] == {"prompt": f"Sort: {word}\n", "answer": "".join(sorted(word))}
    assert tasks[f"repair_text/max/{word}"]["answer"] == max(word)
    assert len(RepairTextTasks(None, "cpu", families=["min"]).tasks()) == 100
    with pytest.raises(ValueError, match="families"):
        RepairTextTasks(None, "cpu", families=["nope"])


def test_the_preset_loads_its_plug_ins_and_they_score():
    cfg = load_config(CONFIG, [])
    assert cfg.rollout.max_turns >= 2 and cfg.rollout.optimize_turns >= 1
    source = load_plugin(cfg.replay.task_source, TaskSource, key="replay.task_source")(
        cfg.replay, "cpu", **cfg.replay.task_source_args
    )
    reward = load_plugin(cfg.verifier.reward_actor, RewardActor, key="verifier.reward_actor")(
        cfg.verifier, **cfg.verifier.reward_actor_args
    )
    task = source.tasks()[0]
    result = reward.verify(VerifyRequest(request_id="r", task=task, candidate=task.payload["answer"] + "!"))
    assert result.passed and result.speedup_eager < 1 and result.error_class is None
    other = reward.verify(VerifyRequest(request_id="r", task=Task(task_id="k", kind="text_match"), candidate="x"))
    assert other.error_class == "infra"
