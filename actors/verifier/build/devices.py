"""Answers to device queries in the compile stage's capture process, which sees no GPU.

A CUDA candidate's module-level code may ask the device about itself before it builds (the
multiprocessor count to size a grid, the compute capability to pick `-arch`): honest code that
failed with "No CUDA GPUs are available" in the capture process, which runs on a compile worker and
must never touch a GPU (a timing window may be open on it). So the verifier (trusted) describes its
device once (`describe`), and the capture process answers torch's device queries from that
description (`install`, before the seal): `torch.cuda.is_available`, `device_count`,
`current_device`, `get_device_properties`, `get_device_capability`, `get_device_name`. Anything that
needs the device itself (a tensor on it) still fails there, as before; the execution sandbox, which
has the GPU, imports the module for real. A candidate that changes the answers changes only what its
own capture records: the execution stage builds nothing and imports only what was built.
"""

from __future__ import annotations

from types import SimpleNamespace

# The properties a description carries (those of torch's CUDA device properties that are plain values).
FIELDS = (
    "name",
    "major",
    "minor",
    "total_memory",
    "multi_processor_count",
    "L2_cache_size",
    "warp_size",
    "max_threads_per_multi_processor",
    "max_threads_per_block",
    "regs_per_multiprocessor",
    "shared_memory_per_block",
    "shared_memory_per_block_optin",
    "shared_memory_per_multiprocessor",
    "is_integrated",
    "is_multi_gpu_board",
    "uuid",
)


def describe(index: int = 0) -> dict:
    """The verifier's CUDA device `index` as plain values (str, int, bool)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    found = {}
    for name in FIELDS:
        value = getattr(props, name, None)
        if isinstance(value, (bool, int, str)):
            found[name] = value
        elif value is not None:
            found[name] = str(value)
    return found


def install(description: dict) -> None:
    """torch's device queries in this process answered from `description` (one device, index 0)."""
    import torch

    props = SimpleNamespace(**{k: v for k, v in description.items() if k in FIELDS})
    cuda = torch.cuda

    def properties(device=None):
        return props

    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.get_device_properties = properties
    cuda.get_device_capability = lambda device=None: (props.major, props.minor)
    cuda.get_device_name = lambda device=None: props.name
