"""launch.bench.learner_kernels on CPU at tiny shapes (eager only: the compiled modes are what the GPU
run compares): every kernel gets its row, the in-place grad is the grad, bad sizes are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from launch.bench import learner_kernels as lk

TINY = ["--device", "cpu", "--tokens", "64", "--chunk-rows", "32", "--vocab", "300", "--padded-vocab", "320"]
TINY += ["--ffn", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--calls", "2"]


def test_every_kernel_gets_a_row_and_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert lk.main([*TINY, "--modes", "eager"]) == 0
    text = capsys.readouterr().out
    rows = json.loads((tmp_path / "learner_kernels.json").read_text())["rows"]
    timed = [r for r in rows if "us" in r]
    names = [c.name for c in lk.cases(lk.Shape(), torch.device("meta"), dict.fromkeys(lk.kernel_functions()))]
    assert [r["kernel"] for r in timed] == names and all(r["mode"] == "eager" for r in timed)
    assert all(r["us"] > 0 and r["max_diff_vs_eager"] == 0 for r in timed)
    assert rows[-1]["kernel"] == "copy bandwidth" and rows[-1]["gb_per_s"] > 0
    swiglu_back = next(r for r in timed if r["kernel"] == "SwiGLU backward")
    assert swiglu_back["bytes"] == 64 * 5 * 48 * 2  # g and y read, the gradient of y written, in bf16
    assert "| SwiGLU backward | eager |" in text and "| copy bandwidth |" in text


def test_the_in_place_grad_writes_what_the_backward_copies():
    fns = lk.kernel_functions()
    shape = lk.Shape(chunk_rows=16, vocab=300, padded_vocab=320)
    case = next(c for c in lk.cases(shape, torch.device("cpu"), fns) if c.name == "logprob grad in place")
    torch.manual_seed(0)
    x, inv_t, target, lse, g, logits = case.make(case.rows)
    expected = fns["grad"](x, inv_t, target, lse, g).clone()
    padding = logits[:, 300:].clone()
    fns["grad_in_place"](x, inv_t, target, lse, g, logits)
    assert torch.equal(logits[:, :300], expected) and torch.equal(logits[:, 300:], padding)


@pytest.mark.parametrize(
    "args,words",
    [(["--vocab", "400"], "--vocab at most --padded-vocab"), (["--calls", "0"], "--calls must be >= 1")],
)
def test_bad_arguments_are_one_line_errors(args, words, capsys):
    with pytest.raises(SystemExit) as err:
        lk.main([*TINY, *args])
    assert err.value.code == 2 and words in capsys.readouterr().err
