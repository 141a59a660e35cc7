"""The timing-fidelity bench's cpu mode (what CI runs, on two kernels): Kiln's speedup beside
KernelBench's method's, per kernel. The ±20% target is a benchmark figure (docs/BENCHMARKS.md),
not asserted here: this checks that both methods produce a figure for each kernel, and that the
reference method is independent of the verifier."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

from launch.bench import timing_fidelity

REPO = Path(__file__).resolve().parents[3]


def test_the_reference_method_imports_nothing_of_the_verifier():
    tree = ast.parse((REPO / "launch/bench/kb_method.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith(("actors", "launch", "configs", "protocols"))], names


def test_cpu_mode_on_two_kernels(tmp_path, capsys):
    out = tmp_path / "fidelity.json"
    rc = timing_fidelity.main(
        ["--backend", "cpu", "--kernels", timing_fidelity.CI_KERNELS, "--repeats", "2", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == timing_fidelity.CI_KERNELS.split(",")
    for r in rows:
        assert r["kiln"]["passed"], r
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        # each method repeated: the reference in a fresh process each time, Kiln with fresh baseline
        # processes (two measurements of one process would agree more closely than this)
        assert len(r["reference"]["speedups"]) == 2 and len(r["kiln"]["eager_s"]) == 2, r
        lo, hi = r["kiln_spread"]
        assert lo <= r["kiln_speedup"] <= hi, r
        # the eager baseline measured beside the first pass's compiles, then again quietly, each time new
        loaded, quiet = r["kiln"]["eager_loaded_s"], r["kiln"]["eager_s"]
        assert loaded > 0 and min(quiet) > 0 and loaded not in quiet and quiet[0] != quiet[1], r["kiln"]
    assert "kernels within ±20%" in printed and "eager loaded/quiet" in printed


def test_an_unknown_kernel_is_one_line(capsys):
    assert timing_fidelity.main(["--backend", "cpu", "--kernels", "level9/nope"]) == 2
    assert "no shipped solution for level9/nope" in capsys.readouterr().err


def test_reference_repeats_from_separate_processes_merge_in_order():
    runs = [
        {"eager_s": [2.0], "candidate_s": [1.0], "speedups": [2.0], "do_bench_speedup": 1.9},
        {"eager_s": [3.0], "candidate_s": [1.0], "speedups": [3.0], "do_bench_speedup": 2.1},
    ]
    merged = timing_fidelity.merge_runs(runs)
    assert merged["speedups"] == [2.0, 3.0] and merged["eager_s"] == [2.0, 3.0]
    assert merged["do_bench_speedup"] == 2.0
    assert timing_fidelity.merge_runs([runs[0], {"error": "kb_method: boom"}]) == {"error": "kb_method: boom"}
