"""The paper-shaped stand-in (launch/bench/paper_standin.py): the most layers whose every pipeline stage
fits, the preset's shape otherwise, and the preset's header telling the same count. The RL step itself
needs four GPUs and megatron-core (docs/BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from configs import load_config
from launch.bench import paper_standin
from launch.driver.model_memory import GIB


def test_the_standin_keeps_the_presets_shape_with_the_most_layers_that_fit():
    preset = load_config(paper_standin.PRESET)
    s = paper_standin.standin(preset, 79.0)
    m, full = s.model, preset.model
    assert (m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size, m.max_seq_len) == (
        full.hidden_size,
        full.num_heads,
        full.num_kv_heads,
        full.intermediate_size,
        full.vocab_size,
        full.max_seq_len,
    )
    assert (s.learner.tensor_parallel, s.learner.pipeline_parallel) == (2, 2)
    assert s.learner.micro_batch_tokens == preset.learner.micro_batch_tokens
    assert m.num_layers % 2 == 0 and m.num_layers < full.num_layers
    assert max(s.stages_gib) <= paper_standin.FIT * 79.0
    bigger = dataclasses.replace(m, num_layers=m.num_layers + 2)  # two more layers no longer fit
    assert max(sum(x.values()) / GIB for x in paper_standin._stages(bigger, s.learner)) > paper_standin.FIT * 79.0
    assert paper_standin.standin(preset, 139.0).model.num_layers > m.num_layers  # a bigger card, more layers


def test_the_presets_header_states_the_standins_layers_and_plan():
    preset = load_config(paper_standin.PRESET)
    s = paper_standin.standin(preset, preset.cluster.gpu_memory_gb)
    header = paper_standin.PRESET.read_text()
    stated = re.search(
        r"with (\d+) decoder layers \(([\d.]+)B\s*#?\s*parameters; the placement plan's estimate ([\d.]+) GiB", header
    )
    assert stated, "configs/musacoder_27b.yaml's header no longer states the stand-in"
    from launch.driver.model_memory import model_shape

    assert int(stated.group(1)) == s.model.num_layers
    assert float(stated.group(2)) == pytest.approx(model_shape(s.model).params / 1e9, abs=0.006)
    assert float(stated.group(3)) == pytest.approx(s.stages_gib[0], abs=0.06)


def test_the_plan_mode_prints_the_standin_and_bad_memory_is_one_line(capsys):
    layers = paper_standin.standin(load_config(paper_standin.PRESET), 79.0).model.num_layers
    assert paper_standin.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert f"{layers} layers of 5120" in out and "TP=2 x PP=2 on 4 GPUs" in out
    assert paper_standin.main(["--plan", "--gpu-gib", "-1"]) == 2
    assert "--gpu-gib must be a positive number" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not even 2 layers fit"):
        paper_standin.main(["--plan", "--gpu-gib", "4"])


def test_the_standins_update_fills_the_pipeline_with_pp_micro_batches():
    """The stand-in checks the first stage's memory against a plan that counts PP micro-batches in
    flight: its one update must hold 2·PP micro-batches (the preset's four mini-batches held one)."""
    import numpy as np

    from actors.learner.batch import micro_batches, mini_batches

    preset = load_config(paper_standin.PRESET)
    s = paper_standin.standin(preset, 79.0)
    pp, tokens = s.learner.pipeline_parallel, s.learner.micro_batch_tokens
    cu_seqlens = np.arange(2 * pp + 1) * tokens
    seq_tokens = np.full(2 * pp, tokens - 1)  # each sequence trains all but its first token

    def per_update(algo) -> list[int]:
        return [len(micro_batches(cu_seqlens, tokens, part)) for part in mini_batches(seq_tokens, algo.ppo_minibatches)]

    assert per_update(paper_standin.one_update(preset.algo)) == [2 * pp]
    assert per_update(preset.algo) == [1] * (2 * pp)  # what the check measured before: an empty pipe
