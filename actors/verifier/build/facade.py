"""The CUDA *facade* prelude: a candidate's .cu compiled with no torch header at all. This module
decides which candidates are built with it and rewrites their text; the C++ sources are in
facade_headers.py (what the candidate's code sees) and facade_lib.py (the library behind it).

Every header nvcc parses is parsed three times (cudafe++, cicc, and the host g++ of cudafe++'s
output) and nvcc has no precompiled headers, so even the lean CUDA prelude (the Tensor class and
the allocation ops) costs most of a CUDA candidate's compile. CUDA candidates' host code uses a
small part of torch: shapes, data pointers, dtype checks, allocation with the input's options,
TORCH_CHECK, the current stream. The facade gives exactly that surface, spelled as torch spells it
(`torch::Tensor`, `at::cuda::getCurrentCUDAStream()`, `torch::empty({n}, x.options())`, ...), from
a header that includes only the CUDA runtime and a few standard headers. The facade-mode thunk TU
declares the bound functions with the facade's type (the declaration text with `torch::Tensor`
rewritten by `facade_declaration`).

A name the facade lacks fails the .cu compile with a missing-name error, and the builder compiles
the unit again against the lean CUDA prelude (compiler.py). Only candidates whose C++ side is the
declarations alone and whose torch includes the facade stands for are tried with it.
"""

from __future__ import annotations

import re

# The torch headers a CUDA candidate may include that the facade stands in for.
COVERED_INCLUDES = frozenset(
    {
        "torch/extension.h",
        "torch/types.h",
        "torch/torch.h",
        "torch/all.h",
        "ATen/ATen.h",
        "ATen/Dispatch.h",
        "ATen/cuda/CUDAContext.h",
        "ATen/cuda/CUDAContextLight.h",
        "c10/cuda/CUDAStream.h",
        "c10/cuda/CUDAGuard.h",
        "c10/cuda/CUDAException.h",
        "ATen/core/Tensor.h",
        "c10/util/Exception.h",
    }
)
_TORCH_INCLUDE = re.compile(r"^(torch|ATen|c10|caffe2|pybind11|THC|cub|thrust)/")
_INCLUDE_LINE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"].*$', re.MULTILINE)
# Types a facade-bound function may take or return (after `torch::Tensor` became the facade's).
_DECL_TYPES = re.compile(r"(?:::)?\b(?:(?:torch|at)::)?Tensor\b")
_OTHER_TORCH = re.compile(r"\b(torch|at|c10|py|pybind11)::|\b(IntArrayRef|Scalar|optional|TensorList|string)\b")


def covers_includes(cu_text: str, includes: list[str]) -> bool:
    """True when every torch-side header the CUDA source includes is one the facade stands for."""
    return all(h in COVERED_INCLUDES for h in includes if _TORCH_INCLUDE.match(h))


def without_covered_includes(cu_text: str) -> str:
    """The source with the covered torch includes commented out (line numbers kept)."""

    def sub(m: re.Match) -> str:
        if m.group(1) in COVERED_INCLUDES:
            return "// " + m.group(0).strip() + " (the Kiln facade stands in)"
        return m.group(0)

    return _INCLUDE_LINE.sub(sub, cu_text)


def facade_declaration(text: str) -> str | None:
    """A bound function's declaration with torch's Tensor spelled as the facade's, or None when it
    names another torch type (the facade binding does not carry it)."""
    rewritten = _DECL_TYPES.sub("::kiln::fc::Tensor", text)
    if _OTHER_TORCH.search(rewritten.replace("::kiln::fc::Tensor", "")):
        return None
    return rewritten
