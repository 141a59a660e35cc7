"""`kiln tasks synth`: the 50 tasks of seed 0 cover every op family and several levels and every one
loads and runs through the task loader, the task feed's source and the verifier's reference loader;
the same seed writes byte-identical files and another seed other files; duplicate graphs are
rejected; `--exclude` drops matching tasks; the CLI answers bad arguments with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from random import Random

import pytest
import torch

from actors.buffer.task_source import load_task_set
from actors.verifier.reference import Reference
from configs import ReplayConfig
from launch.cli.main import main as kiln_main
from tasks.loader import discover, to_task
from tasks.synth import SynthConfig, synthesize
from tasks.synth.builder import Builder
from tasks.synth.canonical import canonical_hash
from tasks.synth.checks import constants, load_source
from tasks.synth.decontam import source_signature
from tasks.synth.dims import evaluate
from tasks.synth.emit import TaskHeader, emit, size_names
from tasks.synth.generate import MANIFEST
from tasks.synth.graph import prune
from tasks.synth.levels import level_of
from tasks.synth.ops import FAMILIES, REGISTRY, resolve_ops
from tasks.synth.sampler import fit_sizes, sample_graph

REPO = Path(__file__).resolve().parents[2]

# A hand-written, KernelBench-style reference (not made by the generator): ReLU of a 2-D input.
FOREIGN_RELU = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """Applies ReLU."""

    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


batch_size = 16
dim = 16384


def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]


def get_init_inputs():
    return []
'''


@pytest.fixture(scope="module")
def seed0(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "seed0"
    return synthesize(SynthConfig(out=out, count=50, seed=0))


def py_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.py"))}


def test_seed0_writes_50_tasks_covering_every_family_and_three_levels(seed0):
    assert seed0.complete and len(py_files(seed0.config.out)) == 50
    covered = seed0.family_tasks()
    assert [f for f in FAMILIES if covered[f] == 0] == []
    assert len(seed0.levels()) >= 3
    # The checks that catch a wrong shape rule never fired: every sampled graph the rules admitted ran.
    assert not {"load", "run", "shape"} & set(seed0.rejected), seed0.rejected
    manifest = json.loads((seed0.config.out / MANIFEST).read_text())
    assert [t["file"] for t in manifest["tasks"]] == [t.file for t in seed0.tasks]
    assert manifest["rejected"] == dict(seed0.rejected)


def test_every_task_loads_and_runs_through_loader_task_source_and_reference(seed0):
    found = discover(seed0.config.out)
    assert len(found) == 50
    levels = {t.file: t.level for t in seed0.tasks}
    for tf in found:
        assert tf.level == levels[str(tf.path.relative_to(seed0.config.out))]
        ref = Reference(to_task(tf, "cpu"), "cpu")
        configs = ref.shape_configs("cpu", trials=5)
        assert [c.label for c in configs] == ["primary", "alt0", "alt1"], tf.task_id
        assert set(ref.primary_overrides("cpu")) == set(ref.defaults), tf.task_id  # every size has a cpu value
        for config in configs:
            trial = ref.trial(ref.instance(config), 0)
            assert all(torch.isfinite(t).all() for t in trial.expected), (tf.task_id, config.label)
    task_set = load_task_set(ReplayConfig(tasks=str(seed0.config.out)), "cpu")
    assert len(task_set.train) + len(task_set.val) == 50


def test_same_seed_writes_identical_bytes_other_seed_other_files(seed0, tmp_path):
    again = synthesize(SynthConfig(out=tmp_path / "again", count=6, seed=0))
    first = {t.file for t in seed0.tasks[:6]}
    original = {k: v for k, v in py_files(seed0.config.out).items() if k in first}
    assert py_files(again.config.out) == original  # attempts draw from (seed, attempt) streams
    twice = synthesize(SynthConfig(out=tmp_path / "twice", count=6, seed=0))
    assert py_files(twice.config.out) == py_files(again.config.out)
    assert (twice.config.out / MANIFEST).read_bytes() == (again.config.out / MANIFEST).read_bytes()
    other = synthesize(SynthConfig(out=tmp_path / "other", count=6, seed=1))
    assert not set(py_files(other.config.out).values()) & set(original.values())
    assert not {t.graph_hash for t in other.tasks} & {t.graph_hash for t in seed0.tasks[:6]}


def test_shape_rules_hold_on_many_random_graphs():
    """The shape rules are sound: for 120 sampled graphs of up to 10 ops, the emitted file runs at its
    cpu and alt shapes and yields the shape the rules predicted (the generator's own checks would count
    a violation as `run`/`shape`; here no graph may violate them)."""
    ops = resolve_ops(None)
    for attempt in range(120):
        graph = sample_graph(Random(f"shape-rules:{attempt}"), ops, 10)
        if graph is None or not fit_sizes(graph):
            continue
        source = emit(graph, TaskHeader(0, canonical_hash(graph), level_of([])))
        module = load_source(source, f"graph{attempt}.py")
        names = size_names(graph)
        for env in ("cpu", "alt0", "alt1"):
            with constants(module, {n: v.values[env] for n, v in zip(names, graph.sizes.vars, strict=True)}):
                torch.manual_seed(attempt)
                with torch.no_grad():
                    out = module.Model(*module.get_init_inputs())(*module.get_inputs())
            want = tuple(evaluate(d, graph.sizes.env(env)) for d in graph.values[graph.output].shape)
            assert tuple(out.shape) == want, (attempt, env, source)


def _residual_graph(inputs_first: bool, swap: bool, op: str = "add"):
    """relu(x) (op) y on (batch, dim) rows, built in two insertion orders."""
    b = Builder(Random(0))
    if inputs_first:
        y = b.input_of_layout("rows")
        x = b.new_input(y.shape, "rows")
    else:
        x = b.input_of_layout("rows")
        y = b.new_input(x.shape, "rows")
    r = b.add("relu", [x], x.shape, "rows")
    out = b.add(op, [y, r] if swap else [r, y], x.shape, "rows")
    return prune(b.graph, out.id)


def test_canonical_hash_ignores_naming_order_and_operand_order_of_commutative_ops():
    base = canonical_hash(_residual_graph(False, False))
    assert canonical_hash(_residual_graph(True, False)) == base
    assert canonical_hash(_residual_graph(False, True)) == base
    assert canonical_hash(_residual_graph(False, False, op="sub")) != base
    sub = canonical_hash(_residual_graph(False, False, op="sub"))
    assert canonical_hash(_residual_graph(False, True, op="sub")) != sub  # sub's operand order matters


def test_duplicate_graphs_are_rejected_and_the_run_says_it_fell_short(tmp_path):
    # relu over (rows), (3-D) and (4-D) inputs: three distinct graphs, whatever the sizes.
    report = synthesize(SynthConfig(out=tmp_path / "relu", count=5, seed=0, ops=("relu",), max_ops=1, max_attempts=40))
    assert len(report.tasks) == 3 and not report.complete
    assert report.rejected["duplicate"] == 40 - 3
    assert len({t.graph_hash for t in report.tasks}) == 3


def test_exclude_drops_a_hand_written_task_with_the_same_op_structure(tmp_path):
    foreign = tmp_path / "kernelbench" / "level1"
    foreign.mkdir(parents=True)
    (foreign / "19_ReLU.py").write_text(FOREIGN_RELU)
    report = synthesize(
        SynthConfig(
            out=tmp_path / "out", count=3, seed=0, ops=("relu", "gelu"), max_ops=1, exclude=(tmp_path / "kernelbench",)
        )
    )
    assert report.complete and report.excluded["structure"] > 0
    assert all(t.ops == ("gelu",) for t in report.tasks)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["excluded"] == {"structure": report.excluded["structure"]}


def test_structure_signature_matches_a_hand_written_fused_task_with_other_attributes():
    """A generated conv2d (5x5, padding 2) -> relu -> bias_add has the op structure of the shipped
    level4/04_conv_relu_bias (3x3, no padding), and a gelu in place of the relu does not."""

    def generated(activation: str) -> str:
        b = Builder(Random(1))
        x = REGISTRY["conv2d"].build(b, b.input_of_layout("image"))
        out = REGISTRY["bias_add"].build(b, REGISTRY[activation].build(b, x))
        return emit(prune(b.graph, out.id), TaskHeader(0, "-", level_of([])))

    shipped = (REPO / "tasks/level4/04_conv_relu_bias.py").read_text()
    assert source_signature(generated("relu"), "a.py") == source_signature(shipped, "b.py")
    assert source_signature(generated("gelu"), "c.py") != source_signature(shipped, "b.py")


def test_exclude_drops_tasks_of_an_earlier_synth_run(seed0, tmp_path):
    report = synthesize(SynthConfig(out=tmp_path / "out", count=4, seed=0, exclude=(seed0.config.out,)))
    assert report.complete
    assert sum(report.excluded.values()) >= 4  # attempts 0..3 are seed 0's first four graphs
    assert not {t.graph_hash for t in report.tasks} & {t.graph_hash for t in seed0.tasks}


def test_level_rule():
    def level(*ops):
        return level_of([(op, REGISTRY[op].family) for op in ops]).level

    assert level("relu", "add", "scale") == 1
    assert level("relu", "softmax") == 2 and level("max_pool2d") == 2
    assert level("linear") == 3 and level("conv2d", "flatten") == 3  # layout ops do not count
    assert level("linear", "gelu") == 4 and level("matmul", "matmul_nt") == 4


def test_cli_writes_tasks_and_prints_the_mix(tmp_path, capsys):
    assert kiln_main(["tasks", "synth", "--out", str(tmp_path / "t"), "--count", "3", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote 3 of 3 tasks to {tmp_path / 't'} (seed 5,") and "levels: L" in out
    assert len(discover(tmp_path / "t")) == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--count", "3", "--seed", "0"], "missing --out"),
        (["--out", "{tmp}/x", "--count", "0", "--seed", "0"], "--count must be at least 1, got 0"),
        (["--out", "{tmp}/x", "--count", "2", "--seed", "0", "--ops", "relu,bogus"], "unknown op or family 'bogus'"),
        (["--out", "{tmp}/x", "--count", "2", "--seed", "0", "--max-ops", "99"], "--max-ops must be in 1..16"),
        (["--out", "{tmp}/x", "--count", "2", "--seed", "0", "--exclude", "{tmp}/none"], "no such file or directory"),
        (["--out", "{tmp}", "--count", "2", "--seed", "0"], "exists and is not an empty directory"),
        (["--out", "{tmp}/x", "--count", "many", "--seed", "0"], "argument --count: invalid int value: 'many'"),
    ],
)
def test_cli_bad_arguments_answer_one_line(args, message, tmp_path, capsys):
    (tmp_path / "occupied").write_text("")
    argv = ["tasks", "synth"] + [a.replace("{tmp}", str(tmp_path)) for a in args]
    try:
        status = kiln_main(argv)
    except SystemExit as stop:  # argparse-level errors
        status = stop.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and message in err, err
    assert err.startswith("kiln tasks synth: ")


def test_kiln_verify_runs_a_synthesized_reference(seed0, verifier_cache_dir, tmp_path):
    """The verifier loads a synthesized reference and runs a candidate against it. The candidate is the
    reference's own PyTorch code as ModelNew: rejected as PyTorch fallback (the compute fence refuses
    the first ATen op inside forward, so no correctness is measured)."""
    task = next(t for t in seed0.tasks if t.level == 4)
    reference = seed0.config.out / task.file
    body = reference.read_text().split('"""', 2)[2]
    candidate = tmp_path / "candidate.py"
    candidate.write_text(body.replace("class Model(nn.Module):", "class ModelNew(nn.Module):"))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "verify",
            "--reference",
            str(reference),
            "--candidate",
            str(candidate),
            "--backend",
            "cpu",
            "--json",
            f"verifier.cache_dir={verifier_cache_dir}",
            "verifier.compile_baseline=never",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout)
    assert result["task_id"] == task.file.removesuffix(".py")
    assert result["error_class"] == "cheating" and result["score"] == -1.0, result["feedback"]
    assert "aten::" in result["feedback"] and "inside forward" in result["feedback"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_seed0_references_run_on_the_gpu_within_the_primary_budget(seed0):
    """At their primary (cuda) shapes, every seed-0 reference runs finite on the GPU with an eager
    forward under 50 ms and 2 GB (the table goes to stdout: run with -s to see it)."""
    from tasks.synth.gpu_check import main

    assert main([str(seed0.config.out)]) == 0
