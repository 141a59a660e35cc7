"""The verifier's pure stages: extraction, the static legality scan, output comparison and the sandbox
wire format (the reward ladder: test_reward.py). No processes, no compiles: fast."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest
import torch

from actors.verifier import wire
from actors.verifier.compare import compare_outputs
from actors.verifier.extract import extract
from actors.verifier.legality import static_scan

REPO = Path(__file__).resolve().parents[2]
MODULE = (
    "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n"
)


# ------------------------------------------------------------------------------------- extract


def test_extract_plain_file_and_fenced_answers():
    assert extract(MODULE).source.strip() == MODULE.strip()
    answer = (
        f"Here is my kernel:\n```cpp\n__global__ void k() {{}}\n```\nand the module:\n```python\n{MODULE}```\nDone."
    )
    got = extract(answer)
    assert got.ok and "class ModelNew" in got.source and "__global__" not in got.source
    several = f"```python\n{MODULE}```\nA better version:\n```python\n{MODULE.replace('return x', 'return x + 0')}```"
    assert "x + 0" in extract(several).source  # the last block defining ModelNew wins


def test_extract_truncated_fence_and_failures():
    assert extract(f"```python\n{MODULE}").ok  # an answer cut off before its closing fence
    assert "no `class ModelNew`" in extract("```python\nclass Model:\n    pass\n```").error
    bad = extract("```python\nclass ModelNew(:\n```")
    assert not bad.ok and "does not parse" in bad.error and "line 1" in bad.error
    assert "empty" in extract("   \n").error
    assert extract(MODULE).source_hash == extract(f"```py\n{MODULE}```").source_hash


# --------------------------------------------------------------------------------- static scan


@pytest.mark.parametrize("path", sorted((REPO / "tasks" / "solutions").rglob("*.py")), ids=lambda p: p.stem)
def test_shipped_solutions_are_statically_clean(path):
    violations, _ = static_scan(extract(path.read_text()).source)
    assert violations == [], [v.describe() for v in violations]


@pytest.mark.parametrize(
    "snippet, needle",
    [
        ("import numpy as np", "import numpy"),
        ("from torch import compile as c", "torch.compile"),
        ("import torch._dynamo", "torch._dynamo"),
        ("torch.allclose = lambda *a: True", "assignment to torch.allclose"),
        ("setattr(torch, 'equal', None)", "setattr(torch"),
        ("import time\ntime.perf_counter = lambda: 0", "assignment to time.perf_counter"),
        ("import sys\nsys.modules['x'] = None", "sys.modules"),
        ("exec('1')", "exec()"),
        ("import ctypes", "import ctypes"),
        ("from level1 import Model", "import level1"),
        ("import os\nos._exit(0)", "os._exit"),
        ("class T(torch.Tensor):\n    pass", "class T(torch.Tensor)"),
        ("s = 'torch::Tensor f(torch::Tensor x) { return at::matmul(x, x); }'", "at::matmul"),
        ("s = 'c10::impl::ExcludeDispatchKeyGuard g(c10::DispatchKey::Python);'", "ExcludeDispatchKeyGuard"),
    ],
)
def test_static_scan_names_the_escape_hatch(snippet, needle):
    violations, _ = static_scan(f"import torch\n{snippet}\n{MODULE}")
    assert any(needle in v.describe() for v in violations), [v.describe() for v in violations]


def test_static_scan_allows_plumbing_and_reports_vendor_libraries():
    cpp = (
        "'torch::Tensor f(torch::Tensor x) { auto y = torch::empty_like(x); at::cuda::getCurrentCUDAStream(); "
        "cublasSgemm(h); return y; }'"
    )
    violations, vendors = static_scan(
        f"import torch\ntorch.backends.cuda.matmul.allow_tf32 = False\ns = {cpp}\n{MODULE}"
    )
    assert violations == [] and vendors == ["cuBLAS"]
    violations, _ = static_scan(f"s = {cpp}\n{MODULE}", allow_vendor_libs=False)
    assert [v.kind for v in violations] == ["vendor_lib"]


# ---------------------------------------------------------------------------------- comparison


def test_compare_tolerances_nan_and_messages():
    exp = torch.linspace(-1, 1, 100).reshape(10, 10)
    assert compare_outputs([exp + 5e-4], [exp]).ok  # fp32 tolerance 1e-3
    bad = exp.clone()
    bad[3, 4] += 0.5
    r = compare_outputs([bad], [exp])
    assert not r.ok and r.mismatched == 1 and "(3, 4)" in r.message and "max abs error 0.5" in r.message
    nan = exp.clone()
    nan[0, 0] = float("nan")
    assert "NaN never passes" in compare_outputs([nan], [nan]).message
    assert "shape" in compare_outputs([exp.reshape(100)], [exp]).message
    assert "dtype float16" in compare_outputs([exp.half()], [exp]).message
    assert not compare_outputs([exp.bfloat16().float()], [exp]).ok  # bf16 rounding exceeds fp32 tolerance
    assert compare_outputs([exp.half()], [exp.half()]).ok
    ints = torch.arange(6)
    assert not compare_outputs([ints + (ints == 5)], [ints]).ok  # integers must match exactly
    inf = torch.tensor([float("inf"), 1.0])
    assert compare_outputs([inf.clone()], [inf]).ok and not compare_outputs([-inf], [inf]).ok
    assert compare_outputs([exp + 0.05], [exp], override=(0.1, 0.0)).ok


# ---------------------------------------------------------------------------------------- wire


def test_wire_roundtrip_and_untrusted_input():
    a, b = socket.socketpair()
    body = {"t": [1, [2.5, None]], "s": "ok", "b": b"\x00\x01"}
    wire.send(a, body)
    assert wire.recv(b) == body
    a.sendall(struct.pack("<I", 4) + b"\xc1\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    with pytest.raises(wire.WireError, match="undecodable"):
        wire.recv(b)
    a.sendall(struct.pack("<I", (1 << 32) - 1))
    with pytest.raises(wire.WireError, match="more than"):
        wire.recv(b, max_bytes=1 << 20)
    a.close()
    with pytest.raises(wire.PeerClosed):
        wire.recv(b)


# ---------------------------------------------------------------------------------- reference


def _task(source: str):
    from protocols import KernelSpec, Task

    return Task(
        task_id="t/plain", kind="kernel", kernel=KernelSpec(name="plain", reference=source, backend="cpu", level=1)
    )


PLAIN_KERNELBENCH = """
import torch
import torch.nn as nn
batch_size = 8
dim = 5
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)
def get_inputs():
    return [torch.randn(batch_size, dim)]
def get_init_inputs():
    return []
"""


def test_reference_shapes_trials_and_fresh_inputs():
    from actors.verifier.reference import Reference
    from tasks.loader import load_tasks

    ref = Reference(_task(PLAIN_KERNELBENCH), "cpu")
    configs = ref.shape_configs("cpu", 4)  # plain KernelBench: one derived batch size
    assert [(c.label, c.overrides, c.trials) for c in configs] == [("primary", {}, 3), ("alt0", {"batch_size": 5}, 1)]
    inst = ref.instance(configs[1])
    a, b = ref.trial(inst, 0), ref.trial(inst, 1)
    assert a.inputs[0].shape == (5, 5) and not torch.equal(a.inputs[0], b.inputs[0])  # fresh seeds
    assert torch.equal(a.expected[0], torch.relu(a.inputs[0]))
    assert ref.program.module.batch_size == 8  # overrides are undone after use
    declared_none = Reference(_task(PLAIN_KERNELBENCH + "KILN_ALT_SHAPES = []\nKILN_TOLERANCE = 1e-5\n"), "cpu")
    assert [c.label for c in declared_none.shape_configs("cpu", 4)] == ["primary"]
    assert declared_none.tolerance() == (1e-5, 1e-5)
    shipped = Reference(next(t for t in load_tasks("tasks/level1", "cpu") if t.task_id == "level1/01_relu"), "cpu")
    assert [c.trials for c in shipped.shape_configs("cpu", 3)] == [2, 1]
    assert shipped.shape_configs("cpu", 3)[0].overrides == {"batch_size": 16, "dim": 4096}


# ------------------------------------------------------------------------- built-library symbols


def test_mangled_names_are_read_without_a_demangler():
    from actors.verifier.build.symbols import qualified_name

    assert qualified_name("_ZN2at4_ops4relu4callERKNS_6TensorE") == ["at", "_ops", "relu", "call"]
    assert qualified_name("_ZN2at3cpu9clamp_minERKNS_6TensorERKN3c106ScalarE") == ["at", "cpu", "clamp_min"]
    assert qualified_name("_ZNK2at10TensorBase8data_ptrIfEEPT_v") == ["at", "TensorBase", "data_ptr"]
    assert qualified_name("_ZN3c104impl23ExcludeDispatchKeyGuardC1ENS_14DispatchKeySetE") == [
        "c10",
        "impl",
        "ExcludeDispatchKeyGuard",
    ]
    assert qualified_name("_ZNSt6vectorIfSaIfEE9push_backERKf") == ["std", "vector", "push_back"]
    assert qualified_name("_Z4reluv") == ["relu"] and qualified_name("dlsym") is None


@pytest.mark.parametrize(
    "symbol, verdict",
    [
        ("_ZN2at4_ops4relu4callERKNS_6TensorE", "deny"),  # ATen compute through the dispatcher
        ("_ZN2at4_ops9clamp_min4callERKNS_6TensorERKN3c106ScalarE", "deny"),
        ("_ZN2at3cpu9clamp_minERKNS_6TensorERKN3c106ScalarE", "deny"),  # a kernel, no dispatcher at all
        ("_ZN2at6native4reluERKNS_6TensorE", "deny"),
        ("_ZN5torch3jit7compileERKSs", "deny"),
        ("syscall", "deny"),
        ("mprotect", "deny"),
        ("open64", "deny"),
        ("__libc_dlsym", "deny"),  # the loader's internals
        ("cuptiActivityDisable", "deny"),  # the device's record of what ran is the verifier's evidence
        # Mechanisms judged by what they reach (provenance), not refused by name: a dispatch-key guard
        # (torch's headers instantiate one in a hand-written PYBIND11_MODULE), run-time lookup (CUB's
        # NVTX dlopen), CUDA graphs (a graph of the candidate's own kernels).
        ("_ZN3c104impl23ExcludeDispatchKeyGuardC1ENS_14DispatchKeySetE", "allow"),
        ("dlsym", "allow"),
        ("dl_iterate_phdr", "allow"),
        ("cudaGraphLaunch", "allow"),
        ("cudaStreamBeginCapture", "allow"),
        ("_ZN2at4_ops19empty_memory_format4callEN3c108ArrayRefINS2_6SymIntEEE", "allow"),  # plumbing
        ("_ZN2at4_ops10empty_like4callERKNS_6TensorE", "allow"),
        ("_ZNK2at10TensorBase8data_ptrIfEEPT_v", "allow"),
        ("_ZN3c106detail14torchCheckFailEPKcS2_jRKSs", "allow"),
        ("_ZN2at4cuda20getCurrentCUDAStreamEa", "allow"),
        ("memcpy", "allow"),
        ("GOMP_parallel", "allow"),
        ("cudaLaunchKernel", "allow"),
        ("PyTuple_New", "allow"),
        ("cublasSgemm_v2", "vendor"),
        ("cblas_sgemm", "vendor"),
    ],
)
def test_imports_are_classified(symbol, verdict):
    from actors.verifier.build.symbols import Allowlist

    allow = Allowlist(
        [
            "aten::relu",
            "aten::clamp_min",
            "aten::clamp_min.Tensor",
            "aten::empty.memory_format",
            "aten::empty_like",
            "aten::add.Tensor",
        ]
    )
    assert allow.classify(symbol)[0] == verdict, allow.classify(symbol)


def test_a_built_library_is_read_from_its_elf_file(tmp_path):
    """A real shared library: its undefined symbols, libraries and search paths, checked."""
    import shutil
    import subprocess

    from actors.verifier.build.elf import read_imports
    from actors.verifier.build.symbols import Allowlist, check_library

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    src = tmp_path / "lib.c"
    src.write_text("#include <sys/mman.h>\nint f(void* p) { return mprotect(p, 4096, 7); }\n")
    so = tmp_path / "lib.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(so), "-Wl,-rpath,/tmp/elsewhere", "-ldl"], check=True)
    imports = read_imports(str(so))
    assert "mprotect" in imports.undefined and "/tmp/elsewhere" in imports.search_paths
    found = check_library(str(so), Allowlist([]), ("/opt/torch/lib",))
    assert {v.what for v in found.violations} >= {"mprotect()", "library search path /tmp/elsewhere"}
    (tmp_path / "junk.so").write_bytes(b"not an ELF file")
    assert check_library(str(tmp_path / "junk.so"), Allowlist([]), ()).violations[0].kind == "native_symbol"


def test_code_loading_flags_are_refused():
    from actors.verifier.build.spec import UnsupportedCall, spec_from_call

    for flags in (
        ["-fplugin=/tmp/p.so"],
        ["-wrapper", "gdb"],
        ["-B/tmp/tools"],
        ["@/tmp/flags"],
        ["-specs=/tmp/s"],
        ["-Wl,--audit=/tmp/a.so"],
        ["-Xlinker", "--plugin"],
    ):
        with pytest.raises(UnsupportedCall, match="not allowed"):
            spec_from_call("m", "int f();", functions=["f"], extra_ldflags=flags)
    assert spec_from_call("m", "int f();", functions=["f"], extra_cflags=["-O3 -march=native", "-fopenmp"])


def test_compiler_output_loses_every_line_about_a_host_file():
    from actors.verifier.build.diagnostics import sanitize

    out = (
        "cpp_source:1:10: fatal error: /etc/passwd: No such file or directory\n"
        '    1 | #include "/etc/passwd"\n      |          ^~~~~~~~~~~~~\n'
        "/home/me/secret.h:1:1: error: 'hunter2' does not name a type\n    1 | hunter2\n      | ^~~~~~~\n"
        "<torch>/ATen/core/TensorBody.h:12:3: error: no member\n"
        "/usr/include/c++/12/bits/stl_vector.h:5: note: candidate\n"
        "cpp_source:4:5: error: expected ';'\n"
    )
    text = sanitize(out)
    assert "passwd" not in text and "hunter2" not in text and "/home" not in text
    assert "<torch>/ATen/core/TensorBody.h:12:3" in text and "<system>/c++/12/bits/stl_vector.h" in text
    assert "cpp_source:4:5: error: expected ';'" in text and "outside your sources" in text


def test_the_seccomp_filter_is_well_formed():
    from actors.verifier.seccomp import seccomp_program

    for exec_allowed in (False, True):
        prog = seccomp_program(exec_allowed)
        assert len(prog) % 8 == 0 and 40 < len(prog) // 8 < 255
    assert len(seccomp_program(False)) == len(seccomp_program(True)) + 24  # execve, execveat, personality
