"""`launch.bench.learner_layout`: a preset's megatron learner alone on its own layout. What runs on
CPU: the layout and plan it would check, and one-line errors for bad input; the run itself needs
torchrun on the learner's GPUs (docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs import load_config
from launch.bench import learner_layout, paper_standin
from launch.driver.model_memory import GIB, megatron_stage_memory, model_shape

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_the_eight_gpu_learner_is_tp2_dp2_on_four_ranks_with_the_plans_estimate(capsys):
    cfg = load_config(CONFIGS / "eight_gpu.yaml")
    s = learner_layout.layout_of(cfg)
    expected = megatron_stage_memory(model_shape(cfg.model), cfg.learner, tp=2, pp=1, dp=2)
    assert s.stages_gib == pytest.approx([sum(x.values()) / GIB for x in expected])
    # DP halves the optimizer's share: the same learner at DP = 1 plans more per rank
    alone = megatron_stage_memory(model_shape(cfg.model), cfg.learner, tp=2, pp=1, dp=1)
    assert sum(alone[0].values()) / GIB > s.stages_gib[0]
    assert learner_layout.main([str(CONFIGS / "eight_gpu.yaml"), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "TP=2 x PP=1" in out and "DP=2, 4 GPUs" in out and f"{s.stages_gib[0]:.1f} GiB of 79" in out


def test_the_runs_batch_fills_whole_micro_batches_with_sequences_the_model_takes():
    """eight_gpu.yaml's micro-batch (16,384 tokens) is twice its max_seq_len: the run's batch packs two
    sequences per micro-batch (its first four-GPU run refused a 16,384-token sequence)."""
    cfg = load_config(CONFIGS / "eight_gpu.yaml")
    s = learner_layout.layout_of(cfg)
    lengths = paper_standin.sequence_lengths(s, micro_batches=4)
    assert max(lengths) <= cfg.model.max_seq_len
    assert sum(lengths) == 4 * cfg.learner.micro_batch_tokens and len(lengths) == 8
    short = load_config(CONFIGS / "eight_gpu.yaml", ["learner.micro_batch_tokens=4096"])
    assert paper_standin.sequence_lengths(learner_layout.layout_of(short), micro_batches=2) == [4096, 4096]


def test_a_pipelined_layout_plans_each_stage(capsys):
    assert learner_layout.main([str(CONFIGS / "eight_gpu.yaml"), "learner.pipeline_parallel=2", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "TP=2 x PP=2" in out and "DP=1, 4 GPUs" in out
    first, last = (float(g) for g in out.split("plan per stage ")[1].split(" GiB")[0].split(", "))
    assert first > last  # 1F1B: the first stage holds PP micro-batches' activations


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no/such.yaml", "--plan"], "config file not found"),
        (["eight_gpu.yaml", "algo.nope=1", "--plan"], "unknown config key"),
        (["eight_gpu.yaml", "cluster.learner_gpus=3", "--plan"], "not a multiple of TP·PP"),
        (["two_gpu.yaml", "--plan"], "the layout check is for the megatron learner"),
        (["eight_gpu.yaml"], "torchrun --nproc-per-node 4"),  # one process where the learner has four ranks
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    path = argv[0] if argv[0].startswith("no/") else str(CONFIGS / argv[0])
    assert learner_layout.main([path, *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
