"""The adversarial suite on the cpu backend: every reward hack in tests/adversarial/{cpu,common} gets the verdict
its header names (zero false passes), the control case passes, and the feedback names the trick.

All cases run concurrently through one KernelVerifier (two sandbox slots), sharing the session's
build cache: the candidates that differ only in Python share one compiled extension.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from actors.verifier.suite import as_expected, load_suite, request_for, suite_tasks, verdict
from actors.verifier.verifier import KernelVerifier
from tasks.loader import load_tasks
from tests.verifier.integrity import config

CASES = load_suite("cpu")
CASES_BY_NAME = {c.name: c for c in CASES}

# What the feedback must mention, so a model can tell what was caught and where.
FEEDBACK = {
    "fallback_python": ["aten::relu", "line 9", "torch.relu"],
    "fallback_tensor_method": ["aten::clamp", "x.clamp"],
    "fallback_nn_module": ["aten::relu"],
    "fallback_cpp_aten": ["at::relu"],
    "fallback_cpp_method": ["aten::clamp_min", "native code"],
    "fallback_try_except": ["aten::relu"],
    "mutates_input": ["modified in place"],
    "output_aliases_input": ["modified in place"],
    "lazy_subclass": ["subclass"],
    "cached_result": ["exactly the output of trial"],
    "cached_copy": ["exactly the output of trial"],
    # A no-op timed run returns fresh uninitialised memory, which may still hold an earlier output's bytes:
    # then it is caught as a replay before the comparison (either names the timed run).
    "call_count": [("while timed", "timed run")],
    "late_thread": ["after forward returned"],
    "python_thread": ["import threading"],
    "numpy_roundtrip": ["numpy"],
    "patch_allclose_static": ["torch.allclose"],
    "patch_allclose_runtime": ["allclose", "comparison functions"],
    "exit_forged_result": ["status 0"],
    "imports_reference": ["tasks.level1"],
    "crash_segfault": ["segmentation fault"],
    "infinite_loop": ["10 s limit"],
    "out_of_memory": ["memory limit"],
    "reduced_precision": ["outside tolerance"],
    "default_shape_only": ["batch_size=3"],
    "uninitialised_memory": ["outside tolerance"],
    # The classes of the trust-boundary issue and their neighbours.
    "gate_modes_disabled": [("aten::relu", "marshal.loads")],
    "gate_patched_findings": ["actors.verifier.gate"],
    "gate_apply_lambda": ["apply_"],
    "gate_redispatch": ["aten::relu"],
    "gate_other_thread": ["aten::relu"],
    "gate_storage_bytes": ["__getitem__"],
    "gate_torch_save": [("write_record", "TypedStorage", "__reduce__"), "torch.save"],
    "native_namespace_alias": ["at::cpu::clamp_min"],
    # A dispatch-key guard is no longer refused by name (torch's headers instantiate them in honest
    # extensions); the ops the case reaches are.
    "native_token_paste": ["at::_ops::abs::call"],
    "native_ops_macro": ["aten::relu"],
    # Run-time lookup is no longer refused by how it looks (CUB's NVTX dlopen is honest): what it reached is.
    "native_dlsym": ["aten::relu"],
    "native_wrap_ldflags": ["aten::relu"],
    "native_pragma_extname": ["aten::relu"],
    "native_proc_mem": ["open()"],
    "native_signal_handler": ["sigaction()"],
    "native_extra_library": ["libz.so.1"],
    "native_compiler_plugin": ["-fplugin"],
    "clock_patch_import": ["actors.verifier.timing"],
    "replay_fingerprint": ["canary"],
    "cache_poison": ["aten::relu"],
    "kill_verifier": ["os.kill"],
    "escape_files_and_processes": ["for writing"],
    "leak_include_host_file": ["outside your sources"],
    "leak_host_file_runtime": ["ValueError"],
    "proc_self_mem": ["/proc/self/mem"],
    "gc_find_gate": ["gc.get_objects"],
    # Found by the red team that did not write the fix (docs/verifier.md).
    "python_mapped_file": ["for writing"],
    "python_frombuffer_alias": ["torch.frombuffer"],
    "python_shared_fd": ["_share_fd_cpu_"],
    "python_pickle_bytes": ["__reduce__"],
    # The second red team's cases, against the sealed sandbox (docs/verifier.md, "what is guaranteed").
    "audit_repointed": ["gc.get_objects"],
    "pytree_laundered_gc": ["gc.get_objects", "line 13"],
    "torch_ctypes_maps_switch": ["dlopen"],
    "ctypes_at_cpu_clamp_min": ["dlopen"],
    "ctypes_at_cpu_maximum": ["ctypes"],
    "del_on_returned_list": ["not a tensor or a tuple/list of tensors"],
    "late_list_iter": ["not a tensor or a tuple/list of tensors"],
    "late_tuple_getitem": ["not a tensor or a tuple/list of tensors"],
    "finalizer_on_freed_tensors": ["aten::relu", "line 17"],
    "unarmed_state_dict": ["aten::relu"],
    "unarmed_to": ["aten::relu"],
    "forged_header_amplified": ["replies are at most"],
    "forged_header_huge_buffer": ["undecodable reply"],
    "huge_output": ["has shape (268435456,)"],
    "zeros_below_atol": ["outside tolerance", "scale"],
    "zeros_kernel_below_atol": ["outside tolerance", "scale"],
    "infra_error_ice": ["internal compiler error"],
    "infra_pragma_message_disk": ["not declared in this scope"],
    "infra_warning_oom_link": ["cannot convert"],
    "infra_internal_reply": ["outside tolerance"],
    "wrapper_globals_switch": ["__globals__"],
    "persistent_worker_thread": ["while timed"],
    "persistent_worker_late": ["while timed"],
    "settle_launched_kernel": ["while timed"],
    "sigalrm_python": ["signal.signal"],
    "sigalrm_raw_syscall": ["while timed"],
    "vendor_blas_sgemm_plain": ["sgemm", "allow_vendor_libs"],
    "vendor_blas_sgemm_upper": ["SGEMM", "allow_vendor_libs"],
    "honest_log_of_negatives": ["produces NaN from finite inputs"],
    "evidence_pipe_closed": ["evidence pipe was closed or replaced", "aten::relu"],
    "frame_walk_to_server": ["sys._getframe", "line 96"],
    "facade_internals": ["function.__globals__", "traceback.tb_frame"],
    "relu6_passes_for_relu": [("large#0", "offset#0", "row_scales#0"), "outside tolerance"],
    "nan_output": ["NaN never passes"],
    # Round 4 (provenance, timed = checked): docs/verifier.md.
    "native_elf_walk_at_cpu_maximum": ["libtorch's operator kernels", "maximum_kernel"],
    "allocator_hook_stage_work": ["while none of your calls ran", "stage"],
    "timed_one_wrong_call": ["while timed"],
    "timed_input_written": [("shares memory", "modified in place")],
    "view_output_no_kernel": ["shares memory with an input"],
    "precompute_table_fp16": ["before the first input"],
    "cast_does_the_op": ["your own code", "copies, casts or fills"],
    # Correctness as a specification: right on input families the candidate cannot predict (P7).
    "softmax_no_max_shift": [("offset#0", "large#0"), "NaN never passes"],
    "layernorm_one_pass_variance": ["offset#0", "offset by", "outside tolerance"],
    "cumprod_zeros_after_64": ["near_one#0", "inputs near 1"],
    "mse_constant_for_randn": ["exactly the output of trial"],
    "mse_constant_unless_unusual": ["trial sensitivity#0 returned exactly the output of trial"],
    # Resources and isolation (docs/verifier.md, P6, P14, P15): the verifier's memory, caches and
    # feedback against floods, and each candidate seeing its own build only.
    "imp_foreign_library": ["libtorch_global_deps"],
    "setdlopenflags_global": ["sys.setdlopenflags"],
    "read_other_builds": ["builds at /sandbox/lib: others=0", "cwd=/sandbox/work", "host=sandbox"],
    "capture_message_flood": ["sent the build service more than"],
    "capture_log_flood": ["crashed the process"],
    "giant_error_text": ["kiln giant text"],
    "elf_many_symbols": ["dynamic symbols"],
}


def suite_config(cache_dir, **overrides):
    """The integrity tests' verifier settings, with shorter runs (5 timed pairs, a 10 s run limit)."""
    return config(cache_dir, **{"verifier.repeats": 5, "verifier.run_timeout_s": 10, **overrides})


@pytest.fixture(scope="module")
def results(verifier_cache_dir):
    """Every case's verdict: the cases of each `config=` group through one verifier with those settings."""
    tasks = suite_tasks("cpu")
    done = {}
    for settings in sorted({c.config for c in CASES}):
        group = [c for c in CASES if c.config == settings]
        verifier = KernelVerifier(suite_config(verifier_cache_dir, **dict(kv.split("=", 1) for kv in settings)))
        try:
            with ThreadPoolExecutor(4) as pool:
                done.update(
                    zip(
                        [c.name for c in group],
                        pool.map(lambda c, verifier=verifier: verifier.verify(request_for(c, tasks)), group),
                        strict=True,
                    )
                )
        finally:
            verifier.close()
    return done


def test_suite_covers_the_issue_list():
    expected = {
        "fallback_python",
        "fallback_tensor_method",
        "fallback_nn_module",
        "fallback_cpp_aten",
        "fallback_cpp_method",
        "fallback_try_except",
        "mutates_input",
        "output_aliases_input",
        "lazy_subclass",
        "cached_result",
        "call_count",
        "late_thread",
        "numpy_roundtrip",
        "uninitialised_memory",
        "patch_allclose_static",
        "patch_allclose_runtime",
        "exit_forged_result",
        "reduced_precision",
        "default_shape_only",
        "imports_reference",
        "control_correct",
    }
    assert expected <= {c.name for c in CASES}
    assert set(FEEDBACK) == {c.name for c in CASES if c.expect != "pass"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_adversarial_case_gets_its_verdict(case, results):
    r = results[case.name]
    assert as_expected(verdict(r), case.expect), f"{case.name}: {case.why}\nfeedback: {r.feedback}\n{r.diagnostics}"
    if case.expect == "pass":
        assert r.score >= 1.0 and r.q == 1.0 and r.speedup_eager is not None and r.speedup_eager > 0
        return
    if case.expect == "infra":  # a broken task (the reference's NaN), not a bad kernel: never trained on
        assert r.score == 0.0 and r.diagnostics.get("broken_task"), r.diagnostics
        return
    assert not r.passed and r.score < 0
    if case.expect == "cheating":
        assert r.score == -1.0 and r.stage == "legality" and r.diagnostics["violations"]
    for needle in FEEDBACK[case.name]:  # a tuple: any one of its alternatives
        alternatives = needle if isinstance(needle, tuple) else (needle,)
        assert any(n in r.feedback for n in alternatives), (
            f"{case.name}: {needle!r} missing from feedback:\n{r.feedback}"
        )


def test_input_families_show_in_the_diagnostics_and_name_the_trials(results):
    """Each family's parameters, trial labels and skips are in diagnostics.families; a family the
    reference cannot take (a cumprod overflows at any offset or larger scale) is skipped and not
    planned, so an honest kernel still has q = 1; a failed trial's feedback names its family.
    Reopened by: dropping families.ALL from families.schedule (no family trial, no entry)."""
    from actors.verifier.families import ALL

    order = ["normal", *ALL, "sensitivity"]
    r = results["layernorm_one_pass_variance"]
    names = [f["family"] for f in r.diagnostics["families"]]
    assert names == order, names
    offset = r.diagnostics["families"][1]
    assert [t["label"] for t in offset["trials"]] == ["offset#0"] and offset["trials"][0]["params"]["exponents"]
    assert "offset#0" in r.feedback and "offset by" in r.feedback
    honest = results["honest_cumprod"]
    assert honest.passed and honest.q == 1.0
    skipped = {f["family"] for f in honest.diagnostics["families"] if f["skipped"] and not f["trials"]}
    assert {"offset", "large", "row_scales"} <= skipped, honest.diagnostics["families"]
    assert len(honest.diagnostics["trials"]) == 4 + len(ALL) + 1 - len(skipped)
    near_one = next(f for f in honest.diagnostics["families"] if f["family"] == "near_one")
    assert "degenerate" not in near_one["trials"][0]  # the family that keeps a cumprod non-degenerate
    plain = next(f for f in honest.diagnostics["families"] if f["family"] == "normal")
    primary = [t for t in plain["trials"] if t["label"].startswith("primary#")]
    assert primary and all("within tolerance of 0" in t.get("degenerate", "") for t in primary)


def test_every_verdict_is_bounded_and_names_no_host_detail(results):
    """Whatever a case made the verifier read or quote, its verdict stays within the bounds of
    redact.py and names no host path, home directory or host name (redacted on the way out).
    Reopened by: removing the caps or the redaction in verifier.KernelVerifier._result."""
    import json
    import os
    import socket
    import tempfile

    from actors.verifier.suite import REPO

    host = [str(REPO), os.path.expanduser("~") + "/", tempfile.gettempdir() + "/", socket.gethostname()]
    host = [h for h in host if len(h) >= 4 and h != "sandbox"]
    for name, r in results.items():
        diagnostics = json.dumps(r.diagnostics)
        assert len(r.feedback) <= 4000 and len(diagnostics) <= 256 << 10, name  # redact.MAX_FEEDBACK, MAX_DIAGNOSTICS
        leaked = [h for h in host if h in r.feedback or h in diagnostics]
        assert leaked == [], (name, leaked)


def test_default_shape_only_gets_partial_credit(results):
    r = results["default_shape_only"]
    assert 0 < r.q < 1 and r.score == pytest.approx(-0.5 + 0.5 * r.q)


def test_vendor_libraries_can_be_switched_off(verifier_cache_dir):
    """A native BLAS call is rejected when verifier.legality.allow_vendor_libs is off."""
    tasks = {t.task_id: t for t in load_tasks("tasks/level3", "cpu")}
    source = """
import torch
import torch.nn as nn

kernel_source = "extern \\"C\\" void cblas_sgemm(); // calls cblas_sgemm( natively"


class ModelNew(nn.Module):
    def forward(self, A, B):
        return torch.empty(A.shape[0], B.shape[1])
"""
    from protocols import VerifyRequest

    verifier = KernelVerifier(suite_config(verifier_cache_dir, **{"verifier.legality.allow_vendor_libs": False}))
    try:
        r = verifier.verify(VerifyRequest(request_id="blas", task=tasks["level3/01_matmul_square"], candidate=source))
    finally:
        verifier.close()
    assert r.error_class == "cheating" and "BLAS" in r.feedback and "allow_vendor_libs" in r.feedback


# ------------------------------------------------------------------------- CUDA cases, on the CPU
# The trust-boundary issue's CUDA cases run on the GPU machine (`python -m launch.bench.gpu_verifier`).
# What can be checked here: they load, none is caught by the static scan (so each reaches the runtime
# defence it is written against), and their CUDA code compiles.
CUDA_ISSUE_CASES = {
    "side_stream_joined_late": "cheating",
    "stale_device_result": "cheating",
    "forged_clock": "cheating",
    "replayed_outputs": "cheating",
    "cuda_graph_in_init": "cheating",
}


def test_cuda_issue_cases_reach_the_runtime_defences():
    from actors.verifier.extract import extract
    from actors.verifier.legality import static_scan

    cuda = {c.name: c for c in load_suite("cuda")}
    for name, expect in CUDA_ISSUE_CASES.items():
        assert cuda[name].expect == expect, name
        violations, _ = static_scan(extract(cuda[name].source()).source)
        assert violations == [], (name, [v.describe() for v in violations])
    assert set(CASES_BY_NAME) & set(cuda) >= {"kill_verifier", "escape_files_and_processes", "gate_redispatch"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_issue_cases_compile(tmp_path, monkeypatch):
    """Every CUDA source of the issue's cases, in one nvcc run against the lean CUDA prelude (each in a
    namespace of its own); linking needs the CUDA libraries, which the CPU torch wheel lacks."""
    import ast
    import re
    import subprocess

    from actors.verifier.build.preludes import PchStore
    from actors.verifier.build.toolchain import Toolchain

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    tc = Toolchain.detect("cuda")
    pch = PchStore(tmp_path / "pch", tc)
    includes, bodies = set(), []
    cuda = {c.name: c for c in load_suite("cuda")}
    for i, name in enumerate(n for n in CUDA_ISSUE_CASES if n != "forged_clock" and n != "cuda_graph_in_init"):
        tree = ast.parse(cuda[name].source())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and "__global__" in str(node.value.value)
            ):
                text = node.value.value
                includes |= set(re.findall(r"^#include .*$", text, re.MULTILINE))
                body = re.sub(r"^#include .*$", "", text, flags=re.MULTILINE)
                bodies.append(f"namespace kiln_case_{i} {{\n{body}\n}}")
    assert len(bodies) == 3
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tasks"))
    from check_cuda_compile import make_shim  # toolkit headers this CPU machine lacks (a script's helper)

    make_shim(tmp_path)
    unit = tmp_path / "cases.cu"
    unit.write_text(f'#include "{pch.header("lean_cuda")}"\n' + "\n".join(sorted(includes)) + "\n" + "\n".join(bodies))
    cmd = [
        tc.nvcc,
        f"-I{tmp_path / 'shim'}",
        *tc.common_flags("kiln_cases"),
        *tc.nvcc_flags(()),
        "-c",
        str(unit),
        "-o",
        str(tmp_path / "cases.o"),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def test_an_include_line_stands_for_the_shared_file_and_a_missing_one_stops_the_suite(tmp_path):
    """Cases that share one extension hold it once (`# kiln-adversarial-include: _name.py`): the
    verifier gets the text as if written out, `_` files are not cases, and an include that is not
    there is one error naming the case."""
    cases = tmp_path / "cpu"
    cases.mkdir()
    (cases / "_shared.py").write_text("import torch\nEXT = 1\n")
    (cases / "uses.py").write_text(
        "# kiln-adversarial: task=level1/01_relu expect=cheating\n# why\n"
        "# kiln-adversarial-include: _shared.py\n\nclass ModelNew: pass\n"
    )
    (case,) = load_suite("cpu", tmp_path)
    assert case.name == "uses"
    assert case.source() == (
        "# kiln-adversarial: task=level1/01_relu expect=cheating\n# why\n"
        "import torch\nEXT = 1\n\nclass ModelNew: pass\n"
    )
    # a common case: its include comes from the backend's directory; a name in both is an error
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "shared_case.py").write_text(
        "# kiln-adversarial: task=level1/01_relu expect=pass\n# why\n# kiln-adversarial-include: _shared.py\n"
    )
    by_name = {c.name: c for c in load_suite("cpu", tmp_path)}
    assert by_name["shared_case"].source().endswith("import torch\nEXT = 1\n")
    (tmp_path / "common" / "uses.py").write_text("# kiln-adversarial: task=level1/01_relu expect=pass\n# why\n")
    with pytest.raises(ValueError, match="the case 'uses' is also in"):
        load_suite("cpu", tmp_path)
    (tmp_path / "common" / "uses.py").unlink()
    (cases / "_shared.py").unlink()
    with pytest.raises(ValueError, match=r"uses\.py: includes _shared\.py, which is not in"):
        load_suite("cpu", tmp_path)
    shipped = [c for backend in ("cpu", "cuda") for c in load_suite(backend)]
    assert sum("kiln-adversarial-include" in c.path.read_text() for c in shipped) >= 30
    assert all("kiln-adversarial-include" not in c.source() for c in shipped)


def test_every_shipped_case_parses_unless_it_tests_extraction():
    """A case that does not parse is answered at extraction and never reaches the defence it is
    there to test (the CUDA cases run only on the GPU machine, so CI checks their text here)."""
    import ast

    for backend in ("cpu", "cuda"):
        for case in load_suite(backend):
            if case.expect != "extract":
                ast.parse(case.source(), filename=str(case.path))
