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
  `notes` (fallbacks taken, cache hits, sandbox notes) and the static legality hints
  `torch_calls` / `tensor_methods` (what the C++/CUDA sources call).
* `BuildService(cache_dir, backend, workers, timeout_s, *, memory_limit_mb=8192, max_processes=64,
  prelude_policy="auto"|"full", pch="auto"|"use", pch_dir=None, gpu_visible=False)` —
  `toolchain_id` names compilers + torch + backend. Precompiled headers live in one machine-wide
  directory (`$KILN_PCH_DIR`, else `~/.cache/kiln/pch`), keyed by toolchain; pch="auto" builds the
  common variants in the background at start-up and any other the first time a candidate misses
  it, pch="use" (tests) only uses what exists. `wait_pch()` blocks until queued builds finish.
  Compile children never see a GPU (`gpu_visible=False`): module-level CUDA work fails there.
* `install_prebuilt(artifacts, toolchain)` — patch load_inline in the execution worker.

How (see the modules): a warm zygote (`zygote.py`, torch imported once) forks one confined child
per candidate (`capture.py`), watched by the service (`service.py`, `proctree.py`: deadline,
process count, memory). load_inline is replaced by a recorder that builds each call
(`compiler.py`): the binding TU is generated from the bound functions' signatures
(`cxx_scan.py`) and cached by signature — a ~1 s thunk TU linked with one prebuilt pybind11
module shell per toolchain (`thunks.py`), or a generated pybind11 TU for types thunks do not
carry; the candidate's code compiles against a lean prelude with a precompiled header
(`preludes.py`), falling back to load_inline's full headers when it needs more; units compile
concurrently, and nvcc's host and device front ends too (`nvcc.py`); results are cached by
content (`cache.py`). Benchmark: `bench.py`; CUDA validation
on a GPU machine: `gpu_check.py`.
load_inline must be called at module level (KernelBench convention); `torch.utils.cpp_extension.load`
(building from files) is refused with a clear message.

Sandbox limits: compile children run as the service's user (confine(): no network, scratch dir,
rlimits, watchdogs), so a hostile candidate could still write into the shared cache or signal the
zygote; the latter only fails the builds in flight ("infra") and the zygote is restarted.
"""

from .prebuilt import PrebuiltMissing, install_prebuilt
from .results import BuildResult
from .service import BuildService
from .spec import ExtensionSpec, UnsupportedCall

__all__ = ["BuildResult", "BuildService", "ExtensionSpec", "PrebuiltMissing", "UnsupportedCall",
           "install_prebuilt"]
