"""The verifier's compile stage: capture a candidate's load_inline calls and build them, fast.

API (used by the verifier core):
    service = BuildService(cache_dir, backend="cpu"|"cuda", workers=2, timeout_s=300)
    result = service.submit(candidate_source).result()      # BuildResult, never raises
    ... in the execution worker, before importing the candidate:
    install_prebuilt(result.artifacts, result.toolchain)   # load_inline imports, never compiles
    service.close()

* `ExtensionSpec` — one load_inline call, normalised; `spec.key(toolchain_id)` is its cache key.
  Beyond the brief's fields it carries `docstrings`, `with_pytorch_error_handling`,
  `no_implicit_headers` and `has_functions`, which change what gets built.
* `BuildResult` — ok, specs, artifacts (key -> .so), error + error_class (None, "compile",
  "timeout", "runtime", "infra"), seconds, phases, cached, vendor_libs; plus `toolchain` (pass it
  to install_prebuilt), `preludes` (key -> "lean" / "full" / "lean->full" / "monolithic(...)"),
  `notes` (fallbacks taken, cache hits), the static legality hints `torch_calls` /
  `tensor_methods` (what the C++/CUDA sources call), `violations` (forbidden imports of the built
  libraries, the capture's audit findings), `capture_exit` and `sandbox` (the jail's layers).
* `BuildService(cache_dir, backend, workers, timeout_s, *, memory_limit_mb=8192, max_processes=64,
  prelude_policy="auto"|"lean"|"full", pch="auto"|"use", pch_dir=None, gpu_visible=False, zygote=None)` —
  `toolchain_id` names compilers + torch + backend. Precompiled headers live in one machine-wide
  directory (`$KILN_PCH_DIR`, else `~/.cache/kiln/pch`), keyed by toolchain; pch="auto" builds the
  common variants in the background at start-up and any other the first time a candidate misses
  it, pch="use" (tests) only uses what exists. `wait_pch()` blocks until queued builds finish.
  Compile children never see a GPU (`gpu_visible=False`): module-level CUDA work fails there.
* `install_prebuilt(artifacts, toolchain)` — patch load_inline in the execution worker.

How (see the modules): one zygote (actors/verifier/zygote.py, torch imported once) forks a jailed
*capture* process per candidate (`capture.py`: its module-level code, load_inline recorded),
watched by the service (`service.py`; `watch.py`: deadline, process count, memory; `pch_builds.py`: the
precompiled headers, built in the background). Each load_inline call is
built by a jailed *build* process (`worker.py`) that runs the compilers in its own directory
(`compiler.py`, its plan and units in `plan.py`): the binding TU is generated from the bound functions' signatures (`cxx_scan.py`)
and cached by signature — a ~1 s thunk TU linked with one prebuilt pybind11 module shell per
toolchain (`thunks.py`), or a generated pybind11 TU for types thunks do not carry; the candidate's
code compiles against a lean prelude with a precompiled header (`preludes.py`), falling back to
load_inline's full headers when it needs more; units compile concurrently, and nvcc's host and
device front ends too (`nvcc.py`); a CUDA unit whose C++ side is only declarations compiles against
the facade instead, with no torch header at all (`facade.py`, `facade_headers.py`, `facade_lib.py`). The service then reads what the library imports
(`symbols.py`: ATen compute, dispatcher bypasses, run-time symbol lookup are legality findings),
publishes it into the content-addressed cache (`cache.py`), which only it writes, and sanitises
compiler output before it becomes feedback (`diagnostics.py`). Benchmark:
`python -m launch.bench.compile`; CUDA validation on a GPU machine: `python -m launch.bench.gpu_compile`.
load_inline must be called at module level (KernelBench convention); `torch.utils.cpp_extension.load`
(building from files) is refused with a clear message, and so are flags that load code into the
compiler or linker (`-fplugin`, `-wrapper`, `-B`, ...).
"""

from .prebuilt import PrebuiltMissing, install_prebuilt
from .results import BuildResult
from .service import BuildService
from .spec import ExtensionSpec, UnsupportedCall

__all__ = ["BuildResult", "BuildService", "ExtensionSpec", "PrebuiltMissing", "UnsupportedCall", "install_prebuilt"]
