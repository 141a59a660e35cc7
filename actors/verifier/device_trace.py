"""The cuda sandbox's device trace: which kernels, copies and memsets ran during a request, from CUPTI's
activity API driven by kiln_native's own C code (native/kiln_trace.h).

Why not torch's profiler: once kineto has started, it stays subscribed to every launch of the process
for the rest of its life, and a timed call paid for it (a relu read 107 µs where KernelBench's method
reads 67). This trace enables CUPTI's kernel, copy and memset records at `start` and disables them at
`stop`; between the two nothing of CUPTI runs, so timed calls that are not traced cost what they cost.

`attach` runs in the sandbox before the seal: it finds the CUPTI library that torch's CUDA build
ships (the one already mapped into the process, else the nvidia wheels' or the toolkit's), loads it,
and runs one empty trace so that CUPTI's first start (its thread, its libraries) happens before any
candidate code exists.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Where CUPTI lives besides the process's own maps: the nvidia wheels torch depends on, and the toolkit.
WHEEL_GLOBS = ("nvidia/cu*/lib/libcupti.so*", "nvidia/cuda_cupti/lib/libcupti.so*")
TOOLKIT_GLOBS = ("extras/CUPTI/lib64/libcupti.so*", "lib64/libcupti.so*")


@dataclass(frozen=True)
class DeviceTrace:
    """kiln_native's trace functions, bound before the seal: start() and stop() -> (records, lost),
    each record (kind, mangled name or "Memcpy HtoD"/"Memset", start_ns, end_ns, stream)."""

    start: Callable[[], None]
    stop: Callable[[], tuple[list, int]]


def cupti_library(cuda_version: str | None) -> str | None:
    """The CUPTI shared library for torch's CUDA `cuda_version` ("13.0"): the mapped one, else one whose
    soname carries that major version, else any."""
    mapped = _mapped()
    if mapped:
        return mapped
    roots = [p for p in sys.path if p and os.path.isdir(p)]
    found = [f for root in roots for g in WHEEL_GLOBS for f in sorted(glob.glob(os.path.join(root, g)))]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += [f for g in TOOLKIT_GLOBS for f in sorted(glob.glob(os.path.join(home, g)))]
    major = (cuda_version or "").split(".")[0]
    matching = [f for f in found if major and f.endswith(f".so.{major}")]
    return (matching or found or [None])[0]


def _mapped() -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
                if "/libcupti.so" in path and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def attach(native: Any, cuda_version: str | None) -> DeviceTrace:
    """Load CUPTI into this process and warm the trace; raises RuntimeError naming what is missing."""
    path = cupti_library(cuda_version)
    if path is None:
        raise RuntimeError(
            "CUPTI (libcupti.so) was not found beside torch's CUDA libraries or in the CUDA toolkit: the cuda "
            "verifier's provenance needs it (pip install nvidia-cuda-cupti for your CUDA)"
        )
    native.trace_attach(path)
    trace = DeviceTrace(native.trace_start, native.trace_stop)
    trace.start()
    trace.stop()
    return trace
