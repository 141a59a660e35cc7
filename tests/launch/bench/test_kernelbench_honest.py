"""launch/bench/kernelbench_honest: every candidate parses, defines ModelNew and names its KernelBench
problem; run.py refuses a missing KB_ROOT with one line (CPU only, nothing is built)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from launch.bench.kernelbench_honest import run

FILES = run.candidate_files()


def test_there_are_ten_candidates_with_level1_4_and_level1_5_among_them():
    problems = {run.problem_of(f) for f in FILES}
    assert len(FILES) == 10 and len(problems) == 10
    assert {stem.split("_")[0] for level, stem in problems if level == "level1"} >= {"4", "5"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_each_candidate_parses_defines_model_new_and_names_its_problem(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert "ModelNew" in classes
    doc = ast.get_docstring(tree) or ""
    assert re.search(r"KernelBench level[123]/\d+_\w+", doc), doc
    level, stem = run.problem_of(path)
    number = stem.split("_")[0]
    assert path.stem.startswith(f"{level}_{number}_")  # file name <level>_<number>_<short name>
    sources = [n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)]
    assert any("__global__" in s for s in sources if isinstance(s, str)), "no CUDA kernel in the file"


def test_missing_kb_root_is_one_line(capsys, tmp_path):
    assert run.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kernelbench_honest:") and "KB_ROOT" in err and "\n" not in err
    assert run.main([str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip()
    assert "KB_ROOT not found" in err and "\n" not in err


def test_a_directory_that_is_not_kernelbench_is_one_line(capsys, tmp_path):
    assert run.main([str(tmp_path), "--backend", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a KernelBench checkout" in err and "\n" not in err
