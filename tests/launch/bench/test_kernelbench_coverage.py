"""`python -m launch.bench.kernelbench_coverage`: every reference of a KernelBench-shaped tree,
renamed ModelNew, gets cheating from the run-time gate (cpu mode, a tiny tree built here)."""

from __future__ import annotations

import json

from launch.bench import kernelbench_coverage as coverage

RELU = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x):
        return torch.relu(x)

batch_size = 8
dim = 64

def get_inputs():
    return [torch.randn(batch_size, dim)]

def get_init_inputs():
    return []
"""

SCALE = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, s):
        super(Model, self).__init__()
        self.s = s

    def forward(self, A):
        return A * self.s

M = 16
N = 24

def get_inputs():
    return [torch.rand(M, N)]

def get_init_inputs():
    return [2.0]
"""


def _tree(root):
    level = root / "KernelBench" / "level1"
    level.mkdir(parents=True)
    (level / "1_Relu.py").write_text(RELU)
    (level / "2_Scale.py").write_text(SCALE)
    (root / "KernelBench" / "level2").mkdir()
    return root


def test_the_renamed_reference_is_the_candidate():
    assert "class ModelNew(nn.Module)" in coverage.renamed(RELU)
    assert "super(ModelNew, self)" in coverage.renamed(RELU) and "class Model(" not in coverage.renamed(RELU)


def test_each_reference_gets_cheating_from_the_run_time_gate(tmp_path, capsys):
    root = _tree(tmp_path / "kb")
    out = tmp_path / "coverage.json"
    rc = coverage.main([str(root), "--backend", "cpu", "--levels", "1", "--trials", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert rc == 0, printed
    assert [r["name"] for r in data["rows"]] == ["1_Relu", "2_Scale"]
    for row in data["rows"]:
        assert (row["error_class"], row["gate"]) == ("cheating", "run-time gate"), row
        assert row["limits"].endswith(" s") and row["data_mb"] is not None
    assert data["summary"]["as_expected"] == 2 and "2/2 cheating from the run-time gate" in printed


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    assert coverage.main([str(tmp_path / "missing"), "--backend", "cpu"]) == 2
    assert coverage.main([str(_tree(tmp_path / "kb")), "--backend", "cpu", "--levels", "4"]) == 2
    assert coverage.main([str(tmp_path / "kb"), "--backend", "tpu"]) == 2
    assert coverage.main([str(tmp_path / "kb"), "--backend", "cpu", "--levels", "2"]) == 2  # an empty level
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 4 and all(line.startswith("kernelbench_coverage: ") for line in lines)


def test_a_later_run_with_the_rows_file_verifies_only_what_is_missing(tmp_path, capsys):
    root = _tree(tmp_path / "kb")
    rows = tmp_path / "rows.jsonl"
    common = [str(root), "--backend", "cpu", "--levels", "1", "--trials", "1", "--rows", str(rows)]
    assert coverage.main([*common, "--limit", "1"]) == 0
    assert [json.loads(x)["name"] for x in rows.read_text().splitlines()] == ["1_Relu"]
    with rows.open("a") as f:
        f.write('{"level": 1, "name": "2_Sc')  # a run killed mid-write: that problem is verified again
    out = tmp_path / "all.json"
    assert coverage.main([*common, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == ["1_Relu", "2_Scale"] and data["summary"]["verified_now"] == 1
    assert data["summary"]["as_expected"] == 2 and data["rows"][1]["timings"]["reference"] >= 0
    assert [json.loads(x)["name"] for x in rows.read_text().splitlines()] == ["1_Relu", "2_Scale"]
    assert coverage.main([*common, "--json", str(out)]) == 0  # nothing left to verify
    assert json.loads(out.read_text())["summary"]["verified_now"] == 0
    capsys.readouterr()
