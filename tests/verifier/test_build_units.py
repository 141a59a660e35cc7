"""The compile stage's pure parts, without a build service: a load_inline call normalised and keyed,
declarations read from C++ sources, the static facts, the symbol check by defining library, the compiler
output trimmed for feedback, flag profiles."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from actors.verifier.build import (
    ExtensionSpec,
    UnsupportedCall,
    cxx_scan,
    diagnostics,
)
from actors.verifier.build.preludes import flag_profile
from actors.verifier.build.spec import spec_from_call


def test_spec_normalisation_and_key():
    a = spec_from_call("m", "int f();", functions=["f"], extra_cflags="-O3")
    b = spec_from_call(name="m", cpp_sources=["int f();"], functions={"f": "f"}, extra_cflags=["-O3"])
    assert a == b and a.key("tc") == b.key("tc") and a.key("tc") != a.key("other-toolchain")
    assert ExtensionSpec.from_dict(a.to_dict()) == a
    c = spec_from_call("m", "int f();", functions={"f": "doc"})
    assert c.docstrings == ("doc",) and c.key("tc") != a.key("tc")
    with pytest.raises(UnsupportedCall):
        spec_from_call("m", "", sycl_sources="x")
    with pytest.raises(UnsupportedCall):
        spec_from_call("not a name", "")
    with pytest.raises(ValueError):
        ExtensionSpec.from_dict({**a.to_dict(), "functions": [1]})


def test_declarations_are_read_from_cpp_sources():
    src = textwrap.dedent("""
        #include <vector>
        using namespace torch;  // f( in a comment
        Tensor f(Tensor x, int64_t k = 3, std::tuple<int, int> t = {1, 2});
        std::vector<torch::Tensor> g(const torch::Tensor& a, double eps=1e-5, const char* s = "a,b") {
            auto l = [](int v) { return v; };
            return {a};
        }
        struct S { int a; };
        """)
    b = cxx_scan.bound_declarations(src, ("f", "g"))
    assert [d.text for d in b.declarations] == [
        "Tensor f(Tensor x, int64_t k, std::tuple<int, int> t);",
        "std::vector<torch::Tensor> g(const torch::Tensor& a, double eps, const char* s);",
    ]
    assert b.preamble == ("using namespace torch;",) and b.has_code
    decl_only = cxx_scan.bound_declarations("torch::Tensor f(torch::Tensor x);", ("f",))
    assert decl_only is not None and not decl_only.has_code
    for unreadable in (
        "template <typename T> T f(T x) { return x; }",
        "static torch::Tensor f(torch::Tensor x) { return x; }",
        "namespace { torch::Tensor f(torch::Tensor x) { return x; } }",
        "torch::Tensor f(torch::Tensor x); torch::Tensor f(torch::Tensor x, int k);",
    ):
        assert cxx_scan.bound_declarations(unreadable, ("f",)) is None, unreadable


def test_static_facts():
    assert cxx_scan.needs_full_torch("#include <torch/csrc/autograd/function.h>\n")
    assert not cxx_scan.needs_full_torch("#include <torch/extension.h>\n#include <ATen/ATen.h>\n")
    assert not cxx_scan.needs_full_torch("// #include <torch/csrc/autograd/function.h>\n")
    lean = cxx_scan.without_umbrella_includes("#include <torch/extension.h>\nint x;\n")
    assert lean.splitlines()[0].startswith("// #include <torch/extension.h>") and lean.splitlines()[1] == "int x;"
    assert cxx_scan.uses_pybind("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}")
    assert cxx_scan.vendor_libs_in_sources(["#include <cublas_v2.h>\n"], ("-lcudnn",)) == {"cublas", "cudnn"}
    assert cxx_scan.vendor_libs_in_symbols(["cublasSgemm_v2"], ["_ZN7cutlass4gemmE"]) == {"cublas", "cutlass"}
    calls, methods = cxx_scan.torch_calls(
        ["auto y = torch::matmul(a, b); x.sum(1); // at::relu(x)"], frozenset({"sum", "data_ptr"})
    )
    assert calls == ["torch::matmul"] and methods == ["sum"]


_TORCH_LIKE = r"""
namespace at { namespace cuda { namespace blas {
template <typename T> void gemm(char, char, long, long, long, T, const T*, long, const T*, long, T, T*, long) {}
template void gemm<float>(char, char, long, long, long, float, const float*, long, const float*, long, float, float*,
                          long);
}}}
namespace google { void helper() {} }
namespace c10 { void plumbing() {} }
extern "C" {
void sgemm_() {}
void SGEMM() {}
void aoti_torch_cpu_relu() {}
void Sleef_expf8_u10() {}
void THPVariable_Wrap() {}
void kiln_internal_entry() {}
void vsExp() {}
}
"""


def test_imports_are_judged_by_the_library_that_defines_them(tmp_path):
    """An import a torch library defines is judged by that library's role: its bundled BLAS is a
    vendor library (whatever the symbol's case), its vectorised math and Python glue are allowed,
    its AOTI C shim is ATen by another door, MKL's vector math (VML) is vendor math, and any other C
    entry is an internal, refused; a
    namespace that is not torch's is bundled vendor code; at::cuda::blas is cuBLAS. Read from a real
    ELF file named like torch's."""
    from actors.verifier.build.elf import read_imports
    from actors.verifier.build.symbols import Allowlist

    lib = tmp_path / "libtorch_cuda.so"
    src = tmp_path / "torch_like.cpp"
    src.write_text(_TORCH_LIKE)
    subprocess.run(["g++", "-shared", "-fPIC", "-O0", str(src), "-o", str(lib)], check=True, timeout=120)
    allow = Allowlist(["aten::relu", "aten::empty.memory_format", "aten::clamp_min"], str(tmp_path))
    defined = {s.split("@")[0] for s in read_imports(str(lib)).defined}
    gemm = next(s for s in defined if s.startswith("_ZN2at4cuda4blas4gemmIf"))
    expected = {
        gemm: ("vendor", "cublas"),
        "sgemm_": ("vendor", "BLAS"),
        "SGEMM": ("vendor", "BLAS"),
        "aoti_torch_cpu_relu": ("deny", "C shim"),
        "Sleef_expf8_u10": ("allow", ""),
        "THPVariable_Wrap": ("allow", ""),
        "kiln_internal_entry": ("deny", "an internal of libtorch_cuda.so"),
        "vsExp": ("vendor", "MKL vector math"),  # VML: honest vendor math, refused as an internal before
        "_ZN6google6helperEv": ("vendor", "bundled google"),
        "_ZN3c108plumbingEv": ("allow", ""),
    }
    assert set(expected) <= defined
    for sym, (kind, words) in expected.items():
        verdict, what = allow.classify(sym)
        assert verdict == kind and words in what, (sym, verdict, what)
    # and what no torch library defines is judged by its name alone
    assert allow.classify("_ZN2at4_ops4relu4callERKNS_6TensorE")[0] == "deny"
    assert allow.classify("_ZN2at6native4reluERKNS_6TensorE")[0] == "deny"
    # Run-time lookup and CUDA graphs are mechanisms, not work: what they reach is judged by provenance
    # (an NVTX dlopen in CUB, a graph of the candidate's own kernels, are honest). The profiling
    # interface is the evidence itself.
    assert allow.classify("dlsym")[0] == "allow" and allow.classify("cudaGraphLaunch")[0] == "allow"
    assert allow.classify("cuptiActivityDisable")[0] == "deny" and allow.classify("__libc_dlsym")[0] == "deny"
    assert allow.classify("cublasSgemm_v2") == ("vendor", "cublas")
    assert allow.classify("cudaLaunchKernel")[0] == "allow"


def test_first_errors_are_trimmed_and_scrubbed():
    out = (
        "/tmp/cache/tmp/abc/kernel_lean.cpp: In function 'at::Tensor f(at::Tensor)':\n"
        "cpp_source:3:5: error: 'retur' was not declared in this scope\n"
        "    3 |     retur x;\n      |     ^~~~~\n"
        "/opt/torch/include/ATen/core/TensorBody.h:10:1: error: something in a header\n" + "noise\n" * 100
    )
    text = diagnostics.first_errors(out, {"/tmp/cache/tmp/abc/": "", "/opt/torch/include": "<torch>"}, ("cpp_source",))
    assert text.splitlines()[0].startswith("cpp_source:3:5: error")
    assert "retur x;" in text and "<torch>/ATen/core/TensorBody.h" in text and "noise" not in text
    assert diagnostics.looks_like_missing_api(text)
    assert not diagnostics.looks_like_missing_api("cpp_source:3:5: error: expected ';' before 'return'")
    assert not hasattr(diagnostics, "is_infra_failure")  # a failure's class never comes from the compiler's text


def test_flag_profiles():
    assert flag_profile(["-O3"]) == flag_profile(["-O2"]) == ("-O2",)
    assert flag_profile([]) == ("-O0",)
    assert flag_profile(["-O3 -march=native", "-Wall", "-fopenmp"]) == ("-O2", "-fopenmp", "-march=native")
    assert flag_profile(["-Ofast"]) == ("-O2", "-ffast-math")


def test_device_queries_at_import_are_answered_from_the_verifiers_device():
    """The capture process sees no GPU; a candidate that asks the device about itself at import (its
    multiprocessor count, its capability) gets the verifier's device's answers (build/devices.py).
    Reopened by: not installing the answers (the query raises: no CUDA device on this machine)."""
    code = (
        "import torch\n"
        "from actors.verifier.build.devices import install\n"
        "install({'name': 'NVIDIA H200', 'major': 9, 'minor': 0, 'multi_processor_count': 132, 'total_memory': 1 << 37})\n"
        "assert torch.cuda.is_available() and torch.cuda.device_count() == 1\n"
        "assert torch.cuda.get_device_properties(0).multi_processor_count == 132\n"
        "assert torch.cuda.get_device_capability() == (9, 0) and torch.cuda.get_device_name(0) == 'NVIDIA H200'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
