"""The CUDA facade prelude (actors/verifier/build/facade.py), on a machine without a GPU.

* every shipped CUDA solution's .cu compiles against the facade (nvcc, no torch header reachable);
* the builder tries the facade first and falls back to the lean CUDA prelude for a name it lacks;
* the facade's Tensor semantics, through the real binding path (facade thunk, module shell,
  facade library) with CPU tensors: the candidate-side code is the same C++, compiled by g++;
* a facade-built library still has its forbidden imports refused by the symbol check.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from actors.verifier.build import cxx_scan, facade
from actors.verifier.build.spec import spec_from_call

REPO = Path(__file__).resolve().parents[2]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) on this machine")


def shipped_cuda_specs():
    """(solution path, ExtensionSpec) for every load_inline call of the shipped CUDA solutions."""
    import torch.utils.cpp_extension as cpp_ext

    out = []
    orig = cpp_ext.load_inline

    def recorder(path: Path):
        def record(*args, **kwargs):
            out.append((path, spec_from_call(*args, **kwargs)))

        return record

    for path in sorted((REPO / "tasks" / "solutions" / "cuda").glob("level*/*.py")):
        cpp_ext.load_inline = recorder(path)
        try:
            # the shipped solutions are trusted repository files; running them is how their calls are read
            exec(compile(path.read_text(), str(path), "exec"), {"__name__": "kiln_facade_test"})  # noqa: S102
        finally:
            cpp_ext.load_inline = orig
    return out


@pytest.fixture(scope="module")
def cuda_builder(tmp_path_factory):
    """An ExtensionBuilder for the cuda backend (sm_90), with the toolchain's facade library and
    module shell built (once per machine, in the machine-wide precompiled-header directory)."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc (the CUDA toolkit) on this machine")
    from actors.verifier.build.cache import ArtifactCache
    from actors.verifier.build.compiler import ExtensionBuilder
    from actors.verifier.build.pch_builds import default_pch_dir
    from actors.verifier.build.preludes import FACADE_LIB, SHELL, PchStore, flag_profile
    from actors.verifier.build.toolchain import Toolchain

    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        tc = Toolchain.detect("cuda")
    finally:
        if old is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST")
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old
    pch = PchStore(default_pch_dir(), tc)
    for prelude, profile in (("lean", flag_profile(["-O1"])), (SHELL, ()), (FACADE_LIB, ())):
        pch.build(prelude, profile)
    root = tmp_path_factory.mktemp("facade-cache")
    return ExtensionBuilder(tc, ArtifactCache(root, tc.digest), pch)


@needs_nvcc
def test_every_shipped_cuda_solution_compiles_against_the_facade(cuda_builder, tmp_path):
    """All shipped solutions in one nvcc TU (each in its own namespace: one compile, not 24), with
    no torch or Python include directory reachable; the object references torch only through the
    facade's own functions."""
    specs = shipped_cuda_specs()
    assert len(specs) >= 20
    parts = []
    for k, (path, spec) in enumerate(specs):
        cu = "\n".join(spec.cuda_sources)
        bindable = cxx_scan.bound_declarations("\n".join(spec.cpp_sources), spec.functions)
        assert bindable is not None and not bindable.has_code, path
        assert facade.covers_includes(cu, cxx_scan.includes(cu)), path
        assert all(facade.facade_declaration(d.text) for d in bindable.declarations), path
        rel = path.relative_to(REPO)
        parts.append(f'namespace kiln_sol_{k} {{\n#line 1 "{rel}"\n{facade.without_covered_includes(cu)}\n}}')
    all_in_one = spec_from_call("t_all_solutions", "", cuda_sources="\n".join(parts))
    names = cuda_builder._write_user_files(tmp_path, "cuda_source", all_in_one.cuda_sources)
    unit = cuda_builder._cuda_unit(all_in_one, tmp_path, names, "facade_cuda")
    assert not any(inc in unit.cmd for inc in cuda_builder.tc.torch_includes)
    cuda_builder._run_all([unit], tmp_path)
    assert unit.ok, unit.output[-4000:]
    nm = subprocess.run(
        ["nm", "-C", "--undefined-only", str(tmp_path / unit.obj)], capture_output=True, text=True, check=False
    )
    undefined = [line.split(None, 1)[-1] for line in nm.stdout.splitlines() if line.strip()]
    assert any(s.startswith("kiln::fc::empty") for s in undefined)
    assert not [s for s in undefined if re.match(r"(at|c10|torch|caffe2)::", s)]


@needs_nvcc
def test_builder_tries_the_facade_then_falls_back_to_lean(cuda_builder, tmp_path):
    relu = next(spec for path, spec in shipped_cuda_specs() if path.name == "01_relu.py")
    (tmp_path / "relu").mkdir()
    plan = cuda_builder._plan(relu, tmp_path / "relu")
    assert plan.facade and {u.how for u in plan.units} == {"facade_cuda", "thunk-facade"}
    # The facade thunk binding parses no torch header either: none is on its include path.
    thunk = next(u for u in plan.units if u.how == "thunk-facade")
    assert not {*cuda_builder.tc.torch_includes, cuda_builder.tc.python_include} & set(thunk.cmd), thunk.cmd
    cuda_builder._compile(relu, tmp_path / "relu", plan)
    assert all(u.ok for u in plan.units), [u.output[-2000:] for u in plan.units if not u.ok]
    assert {u.how for u in plan.units} == {"facade_cuda", "thunk-facade"}

    # at::Half is not in the facade: the .cu is compiled again against the lean CUDA prelude, and
    # bound with the ordinary thunk.
    cu = textwrap.dedent("""
        __global__ void twice(const at::Half* x, at::Half* y, int64_t n) {
            int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
            if (i < n) y[i] = at::Half(2.0f * static_cast<float>(x[i]));
        }
        torch::Tensor twice_fwd(torch::Tensor x) {
            TORCH_CHECK(x.scalar_type() == at::kHalf, "x must be half");
            auto y = torch::empty_like(x);
            const int64_t n = x.numel();
            twice<<<(n + 255) / 256, 256>>>(x.data_ptr<at::Half>(), y.data_ptr<at::Half>(), n);
            return y;
        }
        """)
    half = spec_from_call(
        "t_half",
        "torch::Tensor twice_fwd(torch::Tensor x);",
        cuda_sources="#include <torch/extension.h>\n" + cu,
        functions=["twice_fwd"],
    )
    (tmp_path / "half").mkdir()
    plan = cuda_builder._plan(half, tmp_path / "half")
    assert plan.facade
    cuda_builder._compile(half, tmp_path / "half", plan)
    assert all(u.ok for u in plan.units), [u.output[-2000:] for u in plan.units if not u.ok]
    assert {u.how for u in plan.units} == {"facade_cuda->lean_cuda", "thunk"}
    assert not plan.facade and any("CUDA facade lacked" in n for n in plan.notes)

    # KILN_CUDA_FACADE_OFF=1 (Toolchain.cuda_facade False) and the "lean" policy turn it off.
    from dataclasses import replace

    from actors.verifier.build.compiler import ExtensionBuilder

    for tc, policy in ((replace(cuda_builder.tc, cuda_facade=False), "auto"), (cuda_builder.tc, "lean")):
        off = ExtensionBuilder(tc, cuda_builder.cache, cuda_builder.pch, policy)
        (tmp_path / f"off-{policy}").mkdir()
        assert not off._plan(relu, tmp_path / f"off-{policy}").facade
    assert "no-facade" in replace(cuda_builder.tc, cuda_facade=False).id

    # A C++ side with code of its own sees the tensors too: no facade for it.
    mixed = spec_from_call(
        "t_mixed",
        "torch::Tensor f(torch::Tensor x);\ntorch::Tensor g(torch::Tensor x) { return f(x); }",
        cuda_sources=relu.cuda_sources[0].replace("relu_forward", "f"),
        functions=["g"],
    )
    (tmp_path / "mixed").mkdir()
    assert not cuda_builder._plan(mixed, tmp_path / "mixed").facade


# ------------------------------------------------------------------------------ semantics on CPU
SEMANTICS = r"""
#include <vector>
std::vector<int64_t> shape_of(torch::Tensor x) {
    std::vector<int64_t> out(x.sizes().begin(), x.sizes().end());
    out.push_back(x.dim());
    out.push_back(x.numel());
    out.push_back(x.stride(0));
    out.push_back(x.size(-1));
    out.push_back(x.is_contiguous());
    out.push_back(x.is_cuda());
    out.push_back(static_cast<int64_t>(x.scalar_type()));
    return out;
}
torch::Tensor double_it(torch::Tensor x) {
    TORCH_CHECK(x.dim() >= 1, "need a dimension, got ", x.dim());
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) yp[i] = 2.0f * xp[i];
    return y;
}
torch::Tensor make(int64_t rows, int64_t cols, torch::Tensor like) {
    auto z = torch::zeros({rows, cols}, like.options().dtype(torch::kInt64));
    int64_t* p = z.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows * cols; ++i) p[i] = i;
    return z;
}
std::vector<torch::Tensor> pair(torch::Tensor a, double v) {
    return {torch::full({2}, v, a.options()), torch::ones_like(a)};
}
std::vector<torch::Tensor> plumbing(torch::Tensor x) {  // x: 2 x 3
    auto z = x.clone();
    z.zero_();
    auto f = torch::empty_like(x);
    f.fill_(1.5);
    auto c = torch::empty({3, 2}, x.options());
    c.copy_(x.t());
    return {x.view({3, 2}), x.reshape({6}), x.transpose(0, 1), x.permute({1, 0}), x.unsqueeze(0), x.narrow(1, 1, 2),
            x.select(0, 1), x.to(torch::kFloat64), z, f, c, x.flatten(), x.unsqueeze(0).squeeze(0).detach(),
            x.select(0, 0).unsqueeze(0).expand({4, 3})};
}
int64_t wrong_type(torch::Tensor x) { return x.data_ptr<int32_t>() != nullptr; }
int64_t dispatched(torch::Tensor x) {
    return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dispatched", [&] { return (int64_t)sizeof(scalar_t); });
}
"""
DECLS = """
std::vector<int64_t> shape_of(torch::Tensor x);
torch::Tensor double_it(torch::Tensor x);
torch::Tensor make(int64_t rows, int64_t cols, torch::Tensor like);
std::vector<torch::Tensor> pair(torch::Tensor a, double v);
std::vector<torch::Tensor> plumbing(torch::Tensor x);
int64_t wrong_type(torch::Tensor x);
int64_t dispatched(torch::Tensor x);
"""
FUNCTIONS = ["shape_of", "double_it", "make", "pair", "plumbing", "wrong_type", "dispatched"]


def _link_facade_module(builder, bdir: Path, candidate_cpp: str, decls: str, functions: list[str]) -> Path:
    """candidate_cpp compiled by g++ against the facade prelude, bound by the facade thunk and linked
    with the module shell and the facade library into kiln_ext.so, against CPU torch."""
    tc = builder.tc
    spec = spec_from_call("t_facade_cpu", decls, cuda_sources=candidate_cpp, functions=functions)
    bindable = cxx_scan.bound_declarations(decls, tuple(functions))
    assert bindable is not None
    thunk = builder._thunk_unit(spec, bdir, bindable, True)
    (bdir / "cand.cpp").write_text(f'#include "{builder.pch.header("facade_cuda")}"\n{candidate_cpp}')
    cand_cmd = [
        tc.cxx,
        *tc.cxx_flags(),
        "-isystem",
        os.path.join(tc.cuda_home, "include"),
        "-O1",
        "-c",
        "cand.cpp",
        "-o",
        "cand.o",
    ]
    cand = subprocess.run(cand_cmd, cwd=bdir, capture_output=True, text=True, check=False)
    assert cand.returncode == 0, cand.stderr[-3000:]
    builder._run_all([thunk], bdir)
    assert thunk.ok, thunk.output[-3000:]
    so = bdir / "kiln_ext.so"
    link = [
        tc.cxx,
        "cand.o",
        thunk.obj,
        str(builder.pch.shell_object()),
        str(builder.pch.facade_object()),
        "-shared",
        *tc.link_libs(False),
        f"-L{tc.cuda_libdir}",
        "-lcudart",
        "-o",
        str(so),
    ]
    p = subprocess.run(link, cwd=bdir, capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return so


def z_use_count_after_make(ext, x) -> int:
    return ext.make(2, 2, x)._use_count()


@needs_nvcc
def test_facade_tensor_semantics_through_the_binding(cuda_builder, tmp_path):
    import torch

    so = _link_facade_module(cuda_builder, tmp_path, SEMANTICS, DECLS, FUNCTIONS)
    spec = importlib.util.spec_from_file_location("kiln_ext", so)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)

    x = torch.randn(3, 5)
    assert ext.shape_of(x) == [3, 5, 2, 15, 5, 5, 1, 0, 6]  # kFloat is 6 in c10 and the facade
    xt = x.t()
    assert ext.shape_of(xt)[:2] == [5, 3] and ext.shape_of(xt)[-3] == 0  # a transposed view
    y = ext.double_it(xt)  # contiguous() copy, empty_like, data_ptr<float>
    assert torch.equal(y, 2 * xt) and y.is_contiguous() and y.shape == (5, 3)
    refs = x._use_count()
    for _ in range(100):
        ext.double_it(x)
        ext.shape_of(x)
        ext.pair(x, 1.0)
    assert x._use_count() == refs  # the handle's TensorImpl reference counting balances
    assert y._use_count() == 1 and z_use_count_after_make(ext, x) == 1
    z = ext.make(2, 3, x)
    assert z.dtype == torch.int64 and torch.equal(z, torch.arange(6).view(2, 3))
    full, ones = ext.pair(x, 2.5)
    assert torch.equal(full, torch.full((2,), 2.5)) and torch.equal(ones, torch.ones_like(x))
    w = torch.randn(2, 3)
    want = [
        w.view(3, 2),
        w.reshape(6),
        w.t(),
        w.permute(1, 0),
        w.unsqueeze(0),
        w.narrow(1, 1, 2),
        w[1],
        w.double(),
        torch.zeros_like(w),
        torch.full_like(w, 1.5),
        w.t().contiguous(),
        w.flatten(),
        w,
        w[0].expand(4, 3),
    ]
    got = ext.plumbing(w)
    assert len(got) == len(want) and all(
        g.dtype == e.dtype and torch.equal(g, e) for g, e in zip(got, want, strict=True)
    )
    assert got[0].data_ptr() == w.data_ptr() and got[2].stride() == (1, 3)  # views share storage
    with pytest.raises(RuntimeError, match="need a dimension, got 0"):
        ext.double_it(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="expected scalar type Int but found Float"):
        ext.wrong_type(x)
    assert ext.dispatched(x) == 4 and ext.dispatched(x.double()) == 8
    with pytest.raises(RuntimeError, match="not implemented for 'Long'"):
        ext.dispatched(z)


@needs_nvcc
def test_a_facade_built_library_passes_the_symbol_check_and_cheating_is_refused(cuda_builder, tmp_path):
    from actors.verifier.build import symbols

    allowlist = symbols.Allowlist.from_torch()
    dirs = (cuda_builder.tc.torch_libdir, cuda_builder.tc.cuda_libdir)
    (tmp_path / "clean").mkdir()
    clean = _link_facade_module(cuda_builder, tmp_path / "clean", SEMANTICS, DECLS, FUNCTIONS)
    assert symbols.check_library(str(clean), allowlist, dirs).violations == []

    # ATen compute declared by hand against the facade's Tensor: the import still names aten::relu.
    cheat = SEMANTICS + textwrap.dedent("""
        namespace at { ::kiln::fc::Tensor relu(const ::kiln::fc::Tensor& self); }
        torch::Tensor cheat(torch::Tensor x) { return at::relu(x); }
        """)
    (tmp_path / "cheat").mkdir()
    bad = _link_facade_module(
        cuda_builder, tmp_path / "cheat", cheat, DECLS + "torch::Tensor cheat(torch::Tensor x);", FUNCTIONS + ["cheat"]
    )
    found = symbols.check_library(str(bad), allowlist, dirs).violations
    assert any(v.kind == "native_op" and "relu" in v.what for v in found), found


# ------------------------------------------------------------------------------ GPU machine only
@pytest.mark.gpu
def test_facade_built_candidate_runs_on_the_current_stream(tmp_path):
    """Through BuildService (policy auto: the facade first): the kernel sees torch's current stream,
    also inside `torch.cuda.stream(s)`, and computes the right result."""
    import torch

    from actors.verifier.build import BuildService, install_prebuilt

    cu = r"""
    #include <ATen/cuda/CUDAContext.h>
    __global__ void add_one(const float* x, float* y, int64_t n) {
        int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] + 1.0f;
    }
    torch::Tensor add_one_fwd(torch::Tensor x) {
        TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "x must be a float CUDA tensor");
        auto y = torch::empty({x.numel()}, x.options());
        const int64_t n = x.numel();
        add_one<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return y;
    }
    int64_t stream_of(int64_t device) {
        return (int64_t)(uintptr_t)(cudaStream_t)at::cuda::getCurrentCUDAStream(device);
    }
    """
    src = textwrap.dedent("""
        import torch
        from torch.utils.cpp_extension import load_inline
        ext = load_inline(name="t_facade_gpu", cpp_sources="torch::Tensor add_one_fwd(torch::Tensor x);\\n"
                          "int64_t stream_of(int64_t device);",
                          cuda_sources=r'''CUDA_SOURCE''', functions=["add_one_fwd", "stream_of"])
        """).replace("CUDA_SOURCE", cu)  # after the dedent: the CUDA text has its own indentation

    with BuildService(tmp_path, "cuda", workers=1, timeout_s=300) as svc:
        svc.wait_pch(300)
        r = svc.submit(src).result()
    assert r.ok, r.error
    assert "facade_cuda" in ",".join(r.preludes.values()), r.preludes
    install_prebuilt(r.artifacts, r.toolchain)
    ns: dict = {}
    exec(compile(src, "candidate.py", "exec"), ns)  # noqa: S102 - this test's own candidate, run as it would be
    ext = ns["ext"]
    x = torch.randn(1 << 16, device="cuda")
    assert torch.equal(ext.add_one_fwd(x), x + 1)
    assert ext.stream_of(-1) == torch.cuda.current_stream().cuda_stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert ext.stream_of(-1) == s.cuda_stream
        y = ext.add_one_fwd(x)
    s.synchronize()
    assert torch.equal(y, x + 1)
    with pytest.raises(RuntimeError, match="x must be a float CUDA tensor"):
        ext.add_one_fwd(x.double())
