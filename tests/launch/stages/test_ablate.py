"""`kiln ablate`: a short real ablation on the CPU repair-text workload, in which every arm's own
counter is 0 and above 0 in the full arm; bad input; the table and plot code on synthetic rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.cli.main import main
from launch.observe.metrics import read_metrics
from launch.stages.ablate.arms import ARMS, ArmError, Counter, select
from launch.stages.ablate.summary import Spread, arm_figures, final_reward, run_figures, table
from protocols import metric_keys as mk

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "examples" / "repair_text.yaml"

# The CI ablation: 1 seed, 3 steps per arm. No letter credit, so a one-letter task's failed group ties
# (dynamic sampling acts) and refills, which gives the slow passes that performance turns need more
# draws; p = 0.5 so repair tasks are served within three steps. Measured 2026-11-26 on the 2-core
# machine: about 130 s; full-arm counters: anchored 17, BDR served 15, MirrorPop 10, credited turns 384,
# performance turns 6, tied groups 32.
CI_OVERRIDES = [
    "verifier.reward_actor_args.letter_credit=0",
    "replay.retry.probability=0.5",
    "eval.samples=1",
    "logging.episodes_per_step=0",
]


def test_each_arm_switches_its_mechanism_off(tmp_path, capsys):
    out = tmp_path / "ablation"
    rc = main(["ablate", str(CONFIG), "--seeds", "1", "--steps", "3", "--out", str(out), *CI_OVERRIDES])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| full |" in printed and (out / "ablation.md").read_text().startswith("Ablation: 1 seed")
    full = read_metrics(out / "runs" / "full-seed0")
    for arm in ARMS.values():
        if arm.counter is None:
            continue
        assert (out / f"{arm.name}.png").stat().st_size > 0
        rows = read_metrics(out / "runs" / f"{arm.name}-seed0")
        assert arm.counter.count(rows) == 0, f"{arm.name}: its counter {arm.counter.name} acted"
        assert arm.counter.count(full) > 0, f"full arm: {arm.counter.name} never acted"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ablate"], "give the config file"),
        (["ablate", "no/such.yaml"], "no config file"),
        (["ablate", str(CONFIG), "--arms", "full,no_such_arm"], "unknown arm no_such_arm"),
        (["ablate", str(CONFIG), "--seeds", "0"], "at least 1"),
        (["ablate", str(CONFIG), "--steps", "x"], "invalid int value"),
        (["ablate", str(CONFIG), "algo.no_such_key=1"], "unknown config key"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "runs").exists()


def test_an_existing_ablation_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    assert main(["ablate", str(CONFIG), "--out", str(tmp_path)]) == 2
    assert "holds an ablation already" in capsys.readouterr().err


# ------------------------------------------------------------------------ arms and summary


def test_select_puts_full_first_and_keeps_the_table_order():
    assert [a.name for a in select("no_mirrorpop,no_bdr")] == ["full", "no_bdr", "no_mirrorpop"]
    assert [a.name for a in select(None)] == list(ARMS)
    with pytest.raises(ArmError, match="unknown arm nope"):
        select("nope")


def test_counter_sums_per_step_keys_and_reads_run_totals_last():
    rows = [{"a": 2.0, "t": 1.0}, {"a": 3.0}, {"t": 4.0, "a": None}, {"step": 3}]
    assert Counter("x", summed=("a",)).count(rows) == 5.0
    assert Counter("x", total=("t",)).count(rows) == 4.0
    assert Counter("x", total=("missing",)).count(rows) == 0.0


def _row(step, reward, pass_rate, samples, first=0, repair=0, repair_passed=0, optimize=0):
    return {
        "step": step,
        mk.REWARD_MEAN: reward,
        mk.REWARD_PASS_RATE: pass_rate,
        mk.ROLLOUT_SAMPLES: samples,
        mk.ROLLOUT_FIRST_TURN_PASSES: first,
        mk.ROLLOUT_REPAIR_TURNS: repair,
        mk.ROLLOUT_REPAIR_TURN_PASSES: repair_passed,
        mk.ROLLOUT_OPTIMIZE_TURNS: optimize,
    }


def test_run_figures_by_hand():
    rows = [
        _row(1, -1.0, 0.0, 10, repair=20),
        _row(2, -0.5, 0.25, 20, first=2, repair=10, repair_passed=3, optimize=1),
        _row(3, 0.0, 0.5, 10, first=4, repair=10, repair_passed=2, optimize=2),
        _row(4, 1.0, 1.0, 0),
        {"step": 4, "eval/pass@1": 0.5},  # an evaluation row: no rollout figures
    ]
    figs = run_figures(rows, ARMS["no_perf_turns"].counter)
    assert figs["final reward"] == 1.0  # the last quarter of 4 reward rows: the last one
    assert figs["pass rate"] == pytest.approx((0 + 5 + 5) / 40)
    assert figs["first-turn pass rate"] == pytest.approx(6 / 40)
    assert figs["repair success rate"] == pytest.approx(5 / 40)
    assert figs["counter"] == 3.0
    assert final_reward([{"step": 1}]) is None
    assert run_figures([], None)["repair success rate"] is None


def test_spread_and_table():
    assert Spread.of([1.0, None, 3.0]) == Spread(2.0, 1.0, 3.0)
    assert Spread.of([None]).cell() == "–"
    assert Spread.of([0.5]).cell() == "0.500"
    assert Spread.of([0.25, 0.75]).cell(2) == "0.50 (0.25–0.75)"
    full = [[_row(1, -0.5, 0.5, 8, optimize=2)], [_row(1, -0.7, 0.25, 8, optimize=4)]]
    off = [[_row(1, -0.9, 0.0, 8)], [_row(1, -0.8, 0.125, 8)]]
    arms = select("no_perf_turns")
    assert arm_figures(off, arms[1])["counter"] == Spread(0.0, 0.0, 0.0)
    text = table({"full": full, "no_perf_turns": off}, arms, seeds=2, steps=1)
    lines = text.splitlines()
    assert lines[0].startswith("Ablation: 2 seeds per arm, 1 steps each")
    assert lines[4].startswith("| full | nothing | -0.600 (-0.700–-0.500) | 0.375 (0.250–0.500) |")
    assert "| performance turns: 0.0 | 3.0 (2.0–4.0) |" in lines[5]


def test_plot_writes_a_png(tmp_path):
    from launch.stages.ablate.plot import band, plot_mechanism

    full = [
        [
            _row(1, -0.5, 0.5, 8, optimize=2, repair=4, repair_passed=1),
            _row(2, -0.4, 0.5, 8, optimize=1, repair=4, repair_passed=3),
        ]
    ]
    off = [[_row(1, -0.9, 0.0, 8), _row(2, -0.8, 0.1, 8, repair=2)]]
    arm = ARMS["no_perf_turns"]
    assert band(full, None, arm.counter) == ([1, 2], [2.0, 3.0], [2.0, 3.0], [2.0, 3.0])
    # the repair success rate over the run so far: 1/4 at step 1, (1 + 3)/(4 + 4) at step 2; none to divide yet: no point
    assert band(full, "repair success rate") == ([1, 2], [0.25, 0.5], [0.25, 0.5], [0.25, 0.5])
    assert band(off, "repair success rate") == ([2], [0.0], [0.0], [0.0])
    path = plot_mechanism(full, off, arm, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
