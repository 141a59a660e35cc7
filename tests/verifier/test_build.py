"""The verifier's compile stage (actors/verifier/build): capture, fast compile, cache, sandbox.

End to end with real processes and real compilers. One BuildService serves the whole module
(session-scoped cache, so each distinct source compiles once per session); precompiled headers
come from the machine-wide PCH directory when a previous session built them ("use" mode never
builds them here, except in the one test about PCH building).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import wait
from pathlib import Path

import pytest

from actors.verifier.build import (
    BuildService,
    cxx_scan,
    install_prebuilt,
    nvcc,
)
from actors.verifier.build.spec import spec_from_call

REPO = Path(__file__).resolve().parents[2]
NONCE = uuid.uuid4().hex[:8]  # keeps this session's sources distinct from an earlier session's

RELU_KERNEL = """
torch::Tensor relu_fwd(torch::Tensor x) {{
    x = x.contiguous();
    auto out = torch::empty_like(x);
    const float* src = x.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) dst[i] = src[i] > 0.0f ? src[i] * {scale} : 0.0f;
    return out;
}}
"""


# Scales a float tensor with a loop of its own: the libraries these tests build must pass the symbol
# check (a library that computes with ATen is never handed out), whatever they test.
SCALED = """
static torch::Tensor scaled(torch::Tensor x, double f) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) d[i] = static_cast<float>(s[i] * f);
    return y;
}
"""


def candidate(cpp: str, name: str, functions=("relu_fwd",), flags=("-O2",), forward="relu_fwd", tail=""):
    """A KernelBench-style candidate module around one load_inline call."""
    return textwrap.dedent(f"""
        import torch
        import torch.nn as nn
        from torch.utils.cpp_extension import load_inline

        cpp_source = r'''// session {NONCE}
        {textwrap.indent(textwrap.dedent(cpp), "        ").strip()}
        '''

        ext = load_inline(name={name!r}, cpp_sources=cpp_source, functions={list(functions)!r},
                          extra_cflags={list(flags)!r}, verbose=False)


        class ModelNew(nn.Module):
            def forward(self, x):
                return ext.{forward}(x)
        {tail}
        """)


def relu_candidate(scale: str = "1.0f", name: str = "t_relu") -> str:
    return candidate(RELU_KERNEL.format(scale=scale), name)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = BuildService(
        tmp_path_factory.mktemp("build-cache"), "cpu", workers=2, timeout_s=240, pch="use", memory_limit_mb=4096
    )
    # What production prewarms (the lean PCH and the thunk module shell); a no-op when a previous
    # session on this machine built them already.
    for prelude, profile in svc.default_pch_variants():
        svc.request_pch(prelude, profile, force=True)
    assert svc.wait_pch(300)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def relu_result(service):
    return service.submit(relu_candidate()).result()


def run_prebuilt(result, source: str, body: str) -> subprocess.CompletedProcess:
    """Import `source` in a fresh interpreter after install_prebuilt, then run `body` there."""
    script = textwrap.dedent("""
        import json, sys, types, torch
        from actors.verifier.build import install_prebuilt
        install_prebuilt(json.loads(sys.argv[1]), sys.argv[2])
        mod = types.ModuleType("candidate")
        exec(compile(sys.argv[3], "candidate.py", "exec"), mod.__dict__)
        """) + textwrap.dedent(body)
    import json

    return subprocess.run(
        [sys.executable, "-c", script, json.dumps(result.artifacts), result.toolchain, source],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


# ------------------------------------------------------------------------------ build + run
def test_cpu_candidate_builds_imports_prebuilt_and_computes(relu_result):
    r = relu_result
    assert r.ok, r.error
    assert r.error_class is None and r.error == ""
    assert len(r.specs) == 1 and r.specs[0].name == "t_relu" and r.specs[0].functions == ("relu_fwd",)
    key = r.specs[0].key(r.toolchain)
    assert set(r.artifacts) == {key} and Path(r.artifacts[key]).is_file()
    assert r.preludes[key] == "lean"
    assert r.phases["kernel_compile"] > 0 and r.phases["link"] > 0
    assert "torch::empty_like" in r.torch_calls and "data_ptr" in r.tensor_methods
    assert any("binding: compiled (thunk)" in n for n in r.notes), r.notes
    # Inside the build jail, gcc took the precompiled lean prelude for both units (it says so when not).
    assert not any("was not used" in n for n in r.notes), r.notes
    p = run_prebuilt(
        r,
        relu_candidate(),
        """
        x = torch.randn(1000)
        y = mod.ModelNew()(x)
        assert torch.equal(y, torch.relu(x)), (y, x)
        try:
            mod.ext.relu_fwd("not a tensor")
        except TypeError as e:
            assert "incompatible function arguments" in str(e) and "arg0: torch.Tensor" in str(e), e
        else:
            raise AssertionError("no TypeError")
        print("OK")
        """,
    )
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr


def test_a_refused_precompiled_prelude_is_named_with_gccs_reason(service):
    # A macro the prelude's headers test, defined on the command line: gcc cannot use the PCH built
    # without it and parses the whole prelude; the result's notes say which unit and why.
    r = service.submit(
        candidate(RELU_KERNEL.format(scale="1.0f"), "t_strip", flags=("-O2", "-DSTRIP_ERROR_MESSAGES"))
    ).result()
    assert r.ok, r.error
    refused = [n for n in r.notes if "the precompiled lean prelude was not used" in n]
    assert refused and all("STRIP_ERROR_MESSAGES" in n for n in refused), r.notes


def test_second_submit_is_a_cache_hit(service, relu_result):
    again = service.submit(relu_candidate()).result()
    assert again.ok and again.cached
    assert again.artifacts == relu_result.artifacts
    assert again.seconds < 1.0


def test_prebuilt_refuses_a_call_not_seen_at_capture(relu_result):
    p = run_prebuilt(relu_result, relu_candidate(scale="2.0f"), "")
    assert p.returncode != 0 and "PrebuiltMissing" in p.stderr and "did not build" in p.stderr


def test_same_signatures_share_the_binding_object(service, relu_result):
    r = service.submit(relu_candidate(scale="0.5f", name="t_relu_half")).result()
    assert r.ok, r.error
    assert "binding_compile" not in r.phases
    assert any("binding: cached (thunk)" in n for n in r.notes), r.notes
    p = run_prebuilt(
        r,
        relu_candidate(scale="0.5f", name="t_relu_half"),
        """
        x = torch.randn(64)
        assert torch.allclose(mod.ModelNew()(x), torch.relu(x) * 0.5)
        print("OK")
        """,
    )
    assert "OK" in p.stdout, p.stderr


def test_parallel_submits(service, relu_result):
    sources = [relu_candidate(scale=f"{s}f", name=f"t_relu_par{i}") for i, s in enumerate(("3.0", "4.0", "5.0"))]
    futures = [service.submit(s) for s in sources]
    done, _ = wait(futures, timeout=300)
    results = [f.result() for f in futures]
    assert len(done) == 3 and all(r.ok for r in results), [r.error for r in results]
    assert len({next(iter(r.artifacts.values())) for r in results}) == 3


def test_two_extensions_in_one_candidate_are_two_modules(service):
    # Both are split builds (each a kiln_ext.so): imported under one name, the second would come
    # back as the first one's module (pybind11 caches modules by import name) and lack its function.
    src = textwrap.dedent(f"""
        import torch
        from torch.utils.cpp_extension import load_inline
        # session {NONCE}
        SCALED = {SCALED!r}
        twice = load_inline(name="t_twice", cpp_sources=SCALED + "torch::Tensor twice(torch::Tensor x) {{ return scaled(x, 2); }}",
                            functions=["twice"])
        thrice = load_inline(name="t_thrice", cpp_sources=SCALED + "torch::Tensor thrice(torch::Tensor x) {{ return scaled(x, 3); }}",
                             functions=["thrice"])
        """)
    r = service.submit(src).result()
    assert r.ok and len(r.artifacts) == 2, r.error
    p = run_prebuilt(
        r,
        src,
        """
        x = torch.randn(8)
        assert mod.twice is not mod.thrice
        assert torch.equal(mod.twice.twice(x), x * 2) and torch.equal(mod.thrice.thrice(x), x * 3)
        print("OK")
        """,
    )
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr


def test_a_thunk_binding_carries_every_supported_type(service):
    # The thunk ABI's types end to end (thunks.py): each argument converted by the module shell,
    # each result back; a tuple result, lists, an optional, a string and a void function included.
    cpp = (
        """
        #include <torch/extension.h>
        #include <tuple>
        """
        + SCALED
        + """
        std::tuple<torch::Tensor, int64_t> split(torch::Tensor x, int64_t k, double s, bool neg) {
          return std::make_tuple(scaled(x, neg ? -s : s), k + 1);
        }
        std::vector<torch::Tensor> twice_all(std::vector<torch::Tensor> xs, c10::IntArrayRef shape) {
          std::vector<torch::Tensor> out;
          for (auto& x : xs) out.push_back(scaled(x, 2).reshape(shape));
          return out;
        }
        int count(c10::optional<torch::Tensor> x, std::string tag, std::vector<int64_t> dims) {
          return (x.has_value() ? 100 : 0) + static_cast<int>(tag.size()) * 10 + static_cast<int>(dims.size());
        }
        void nothing(float f) {}
        """
    )
    src = candidate(cpp, "t_types", functions=("split", "twice_all", "count", "nothing"), forward="twice_all")
    r = service.submit(src).result()
    assert r.ok, r.error
    assert any("binding: compiled (thunk)" in n for n in r.notes), r.notes
    p = run_prebuilt(
        r,
        src,
        """
        x = torch.randn(6)
        y, k = mod.ext.split(x, 4, 2.0, True)
        assert torch.equal(y, x * -2.0) and k == 5
        a, b = mod.ext.twice_all([x, x + 1], [2, 3])
        assert torch.equal(a, (x * 2).reshape(2, 3)) and torch.equal(b, ((x + 1) * 2).reshape(2, 3))
        assert mod.ext.count(x, "ab", [1, 2, 3]) == 123 and mod.ext.count(None, "", []) == 0
        assert mod.ext.nothing(1.5) is None
        print("OK")
        """,
    )
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr


def test_module_level_calls_into_the_extension_work(service):
    # Also: an explicit #include <torch/extension.h> (common in model output) still compiles lean.
    src = candidate(
        "#include <torch/extension.h>\n" + RELU_KERNEL.format(scale="1.0f"),
        "t_relu_selftest",
        tail="assert torch.equal(ext.relu_fwd(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))\n",
    )
    r = service.submit(src).result()
    assert r.ok, r.error
    assert list(r.preludes.values()) == ["lean"]


# ------------------------------------------------------------------------------ preludes
def test_api_outside_the_lean_prelude_falls_back_to_full_headers(service):
    cpp = RELU_KERNEL.format(scale="1.0f").replace(
        "x = x.contiguous();", "TORCH_CHECK(torch::autograd::GradMode::is_enabled() || true);\n    x = x.contiguous();"
    )
    r = service.submit(candidate(cpp, "t_relu_full")).result()
    assert r.ok, r.error
    key = r.specs[0].key(r.toolchain)
    assert r.preludes[key] == "lean->full"
    assert any("recompiled with the full torch headers" in n for n in r.notes)


def test_signature_types_thunks_do_not_carry_get_a_pybind11_binding(service):
    cpp = RELU_KERNEL.format(scale="(float)scales[0]").replace(
        "(torch::Tensor x)", "(torch::Tensor x, std::vector<double> scales)"
    )
    src = candidate(cpp, "t_relu_scales").replace("ext.relu_fwd(x)", "ext.relu_fwd(x, [3.0])")
    r = service.submit(src).result()
    assert r.ok, r.error
    assert any("pybind11 binding" in n for n in r.notes), r.notes
    p = run_prebuilt(
        r,
        src,
        """
        x = torch.randn(32)
        assert torch.equal(mod.ModelNew()(x), torch.relu(x) * 3)
        print("OK")
        """,
    )
    assert "OK" in p.stdout, p.stderr


def test_no_implicit_headers_builds_as_load_inline_does(service):
    """One TU with the generated module, as load_inline writes it (here with light headers of the
    candidate's own choosing, so the test stays cheap); the module takes the extension's name."""
    cpp = (
        "#include <ATen/ATen.h>\n#include <torch/csrc/utils/pybind.h>\n#include <torch/csrc/Exceptions.h>\n"
        + RELU_KERNEL.format(scale="1.0f").replace("torch::", "at::")
    )
    src = candidate(cpp, "t_relu_own_headers").replace("verbose=False", "verbose=False, no_implicit_headers=True")
    r = service.submit(src).result()
    assert r.ok, r.error
    key = r.specs[0].key(r.toolchain)
    assert r.preludes[key].startswith("monolithic") and Path(r.artifacts[key]).name == "t_relu_own_headers.so"
    p = run_prebuilt(
        r,
        src,
        """
        x = torch.randn(32)
        assert torch.equal(mod.ModelNew()(x), torch.relu(x))
        print("OK")
        """,
    )
    assert "OK" in p.stdout, p.stderr


# ------------------------------------------------------------------------------ failures
def test_compile_error_names_the_users_line(service):
    broken = RELU_KERNEL.format(scale="1.0f").replace(
        "auto out = torch::empty_like(x);", "auto out = torch::empty_like(x)"
    )
    r = service.submit(candidate(broken, "t_broken")).result()
    assert not r.ok and r.error_class == "compile"
    lines = r.error.splitlines()
    first = next(i for i, line in enumerate(lines) if "error" in line)
    # cpp_source line 4 lacks its ';', so g++ stops at the first token of line 5.
    assert lines[first].startswith("cpp_source:5:") and "expected ',' or ';'" in lines[first], r.error
    user_line_5 = r.specs[0].cpp_sources[0].splitlines()[4]
    assert lines[first + 1].split("|", 1)[1].strip() == user_line_5.strip(), r.error  # the quoted code
    assert "/tmp/" not in r.error and str(REPO) not in r.error


def test_unsupported_call_is_a_compile_error(service):
    src = "from torch.utils.cpp_extension import load\next = load(name='x', sources=['x.cpp'])\n"
    r = service.submit(src).result()
    assert r.error_class == "compile" and "load_inline" in r.error


@pytest.mark.parametrize(
    "code, error_class, words",
    [
        ("while True:\n    pass\n", "timeout", ["did not finish"]),
        ("import os\nos._exit(0)\n", "runtime", ["exit status 0"]),
        ("import ctypes\nctypes.string_at(0)\n", "runtime", ["import ctypes", "not allowed"]),
        ("import torch\nx = torch.ones(50 * 2**30 // 4)\n", "runtime", ["memory"]),
        ("raise ValueError('boom')\n", "runtime", ["ValueError: boom", "line 2: `raise ValueError('boom')`"]),
    ],
)
def test_module_level_failures_give_a_clean_result(service, short_service, relu_result, code, error_class, words):
    svc = short_service if error_class == "timeout" else service
    r = svc.submit(f"# {NONCE}\n" + code).result()
    assert not r.ok and r.error_class == error_class, (r.error_class, r.error)
    assert all(w.lower() in r.error.lower() for w in words), r.error
    assert svc.submit(relu_candidate()).result().ok  # and the service keeps serving


def test_fork_bomb_is_contained(short_service):
    """The capture's private uid has a process limit (the kernel refuses the forks), and everything it
    started dies with its PID namespace: nothing is left under the zygote afterwards."""
    code = (
        "import os, time\nfor _ in range(400):\n    if os.fork() == 0:\n        time.sleep(120)\n"
        "        os._exit(0)\ntime.sleep(120)\n"
    )
    r = short_service.submit(code).result()
    assert r.error_class in ("runtime", "timeout")
    assert "Resource temporarily unavailable" in r.error or "processes" in r.error or "did not finish" in r.error
    time.sleep(0.5)
    zygote_children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == short_service.zygote.pid]
    assert zygote_children == []


def _ppid(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


@pytest.fixture(scope="module")
def short_service(service):
    svc = BuildService(service.cache_dir, "cpu", workers=1, timeout_s=4, pch="use", max_processes=32)
    yield svc
    svc.close()


def test_a_dead_zygote_is_replaced(short_service, relu_result):
    os.kill(short_service.zygote.pid, 9)
    os.waitpid(short_service.zygote.pid, 0)
    r = short_service.submit(f"# {NONCE} after the zygote died\nimport math\n").result()
    assert r.ok and r.specs == [], r.error


def test_bad_input_is_answered_not_raised(service):
    r = service.submit(b"not a string").result()  # type: ignore[arg-type]
    assert not r.ok and r.error_class == "runtime"
    r = service.submit("def broken(:\n").result()
    assert r.error_class == "runtime" and "SyntaxError" in r.error


# ------------------------------------------------------------------------------ the canary
def test_a_failure_that_looks_like_the_machine_is_decided_by_a_known_good_build(service, tmp_path, monkeypatch):
    """Class 10: a build process that died without an answer is the machine's only if a known-good
    extension fails to build right after; never from what the compiler printed."""
    deadline = time.monotonic() + 120
    died = {"ok": False, "infra": True, "unit": "builder", "message": "the build process ended without an answer"}
    judged = service.extensions._confirm_infra(dict(died), tmp_path, deadline)
    assert judged["infra"] is False and "a known-good extension built" in judged["message"]
    monkeypatch.setattr(service.extensions, "_toolchain_paths", lambda: ())  # a machine whose compiler is gone
    judged = service.extensions._confirm_infra(dict(died), tmp_path, deadline)
    assert judged["infra"] is True and "failed to build as well" in judged["message"]


# ------------------------------------------------------------------------------ CUDA, without a GPU
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_kernel_unit_compiles_with_the_lean_prelude(tmp_path, monkeypatch):
    """The CUDA path up to linking (no GPU, and the CPU torch wheel has no CUDA libraries)."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    from actors.verifier.build.cache import ArtifactCache
    from actors.verifier.build.compiler import ExtensionBuilder
    from actors.verifier.build.preludes import PchStore
    from actors.verifier.build.toolchain import Toolchain

    tc = Toolchain.detect("cuda")
    assert tc.arch_flags == ("-gencode=arch=compute_90,code=sm_90",) and tc.nvcc
    builder = ExtensionBuilder(tc, ArtifactCache(tmp_path, tc.digest), PchStore(tmp_path / "pch", tc))
    cu = textwrap.dedent("""
        __global__ void scale_kernel(const float* x, float* y, int64_t n) {
            int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
            if (i < n) y[i] = 2.0f * x[i];
        }
        torch::Tensor scale(torch::Tensor x) {
            TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
            auto y = torch::empty_like(x);
            const int64_t n = x.numel();
            scale_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
            return y;
        }
        """)
    cpp = "torch::Tensor scale(torch::Tensor x);"
    spec = spec_from_call("t_scale", cpp, cuda_sources="#include <torch/extension.h>\n" + cu, functions=["scale"])
    bindable = cxx_scan.bound_declarations(cpp, ("scale",))
    assert bindable is not None and not bindable.has_code  # no C++ kernel TU: binding + .cu only
    cuda = builder._cuda_unit(
        spec, tmp_path, builder._write_user_files(tmp_path, "cuda_source", spec.cuda_sources), "lean_cuda"
    )
    thunk = builder._thunk_unit(spec, tmp_path, bindable)
    # nvcc's host and device front ends run concurrently (nvcc.py), not as one plain nvcc call.
    assert nvcc.plan(cuda.cmd, tmp_path, tmp_path / "dryrun") is not None
    builder._run_all([cuda, thunk], tmp_path)
    assert cuda.ok, cuda.output[-3000:]
    assert thunk.ok, thunk.output[-3000:]
    assert (tmp_path / cuda.obj).stat().st_size > 0 and (tmp_path / thunk.obj).stat().st_size > 0


# ------------------------------------------------------------------------------ GPU machine only
@pytest.mark.gpu
def test_cuda_candidate_builds_and_runs_on_the_gpu(tmp_path):
    import torch

    cu = """
    __global__ void add_one(const float* x, float* y, int64_t n) {
        int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] + 1.0f;
    }
    torch::Tensor add_one_fwd(torch::Tensor x) {
        auto y = torch::empty_like(x);
        const int64_t n = x.numel();
        add_one<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
        return y;
    }
    """
    src = textwrap.dedent("""
        import torch
        from torch.utils.cpp_extension import load_inline
        ext = load_inline(name="t_add_one", cpp_sources="torch::Tensor add_one_fwd(torch::Tensor x);",
                          cuda_sources=r'''CUDA_SOURCE''', functions=["add_one_fwd"])
        """).replace("CUDA_SOURCE", cu)  # after the dedent: the CUDA text has its own indentation

    with BuildService(tmp_path, "cuda", workers=1, timeout_s=300) as svc:
        r = svc.submit(src).result()
    assert r.ok, r.error
    install_prebuilt(r.artifacts, r.toolchain)
    ns: dict = {}
    exec(compile(src, "candidate.py", "exec"), ns)  # noqa: S102 - this test's own candidate, run as it would be
    x = torch.randn(4096, device="cuda")
    assert torch.equal(ns["ext"].add_one_fwd(x), x + 1)
