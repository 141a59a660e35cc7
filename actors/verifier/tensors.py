"""Byte-level facts about tensors that the trusted side of a run uses (runner.py, performance.py):
their size, their dtype's wire name, bit-for-bit equality and a digest."""

from __future__ import annotations

import hashlib

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def nbytes(items) -> int:
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals the same NaN: outputs that hold NaN, from a bug or uninitialised
    memory, have not changed because NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        if t.numel():
            h.update(memoryview(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()
