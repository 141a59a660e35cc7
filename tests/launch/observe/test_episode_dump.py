"""Episode dumps (launch/observe/episode_dump.py): an episode reads as a conversation with its verdicts,
reward terms and fate; dumps are chosen by kind; truncation and bad tokens."""

from __future__ import annotations

import pytest

from configs import AlgoConfig
from launch.observe.episode_dump import EpisodeDumper, read_index
from protocols import RepairContext
from tests.launch.observe.episodes import _dumper, _episode, _failed, _result, _task, _turn


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
        # a group of two, R = -1 and -0.275; per-turn values (-1), (-0.275, 1.5): pooled mean 0.075, std 1.0502
        "advantage per turn -0.333, +1.357 in its group of 2 (R: -1.000, -0.275)",
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
    # The session ends: an episode that arrived after step 2's dump and first shows a mechanism is
    # dumped under step 2, alone (no best or worst again); nothing new to show, no file.
    late = _episode("d0", [-1.0], [_turn("p", "slow", _failed("runtime", "timeout"))], group="g4")
    dumper.add([late, _episode("d1", [1.0], [_turn("p", "good", ok)], group="g4")])
    end = dumper.dump_unshown(2)
    assert end is not None and end.name == "step-000002-end.txt"
    rows = [r for r in read_index(tmp_path) if r["file"] == end.name]
    assert [(r["step"], r["episode_id"]) for r in rows] == [(2, "d0")]
    assert rows[0]["why"] == ["first to show: verdict timeout"]
    assert dumper.dump_unshown(2) is None


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
