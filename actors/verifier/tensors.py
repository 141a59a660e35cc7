"""Byte-level facts about tensors that the trusted side of a run uses (runner.py, performance.py):
their size, their dtype's wire name, bit-for-bit equality and a fingerprint; and page-locking the
host memory both sides of a run copy through (the I/O arena)."""

from __future__ import annotations

import hashlib

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def nbytes(items) -> int:
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


# Bit-for-bit comparisons and fingerprints go slice by slice: no whole-tensor temporary (at
# KernelBench's sizes an output is gigabytes).
SLICE_BYTES = 1 << 25
# A tensor up to this size is fingerprinted whole; a larger one by FINGERPRINT_SAMPLES elements at
# positions secret to the run (a replayed output repeats every byte, so it repeats those; an honest
# wrong output does not match a correct one at 65536 secret places).
FINGERPRINT_WHOLE_BYTES = 1 << 20
FINGERPRINT_SAMPLES = 1 << 16


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals the same NaN: outputs that hold NaN, from a bug or uninitialised
    memory, have not changed because NaN != NaN); compared on the device where either one is, slice
    by slice."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    device = a.device if a.device.type != "cpu" else b.device
    x, y = _bytes(a), _bytes(b)
    for start in range(0, x.numel(), SLICE_BYTES):
        end = start + SLICE_BYTES
        if not torch.equal(x[start:end].to(device), y[start:end].to(device)):
            return False
    return True


def fingerprint(tensors: list[torch.Tensor], key: int) -> str:
    """A digest of `tensors` for telling whether an output repeats an earlier one: every byte of a
    small tensor, FINGERPRINT_SAMPLES elements of a large one at positions drawn from `key` (one
    secret per run, so every trial of a shape is sampled at the same places)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        if not t.numel():
            continue
        flat = t.detach().reshape(-1)
        if t.numel() * t.element_size() > FINGERPRINT_WHOLE_BYTES:
            places = torch.randint(
                t.numel(), (FINGERPRINT_SAMPLES,), generator=torch.Generator().manual_seed(key ^ t.numel())
            )
            flat = flat[places.to(flat.device)]
        h.update(memoryview(_bytes(flat.to("cpu")).numpy()))
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def page_lock(t: torch.Tensor, portable: bool = False) -> bool:
    """Register a host tensor's memory with CUDA as page-locked (cudaHostRegister), so copies between
    it and the device go by DMA at the bus's speed; `portable`: for every GPU's context of the process,
    not only the current device's. False, and nothing changed, without CUDA or where the driver
    refuses (the memory stays pageable: copies are slower, not wrong)."""
    if not torch.cuda.is_available() or t.device.type != "cpu" or not t.numel():
        return False
    cudart = torch.cuda.cudart()
    flags = 1 if portable else 0  # cudaHostRegisterPortable
    return cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), flags) == cudart.cudaError.success


def page_unlock(t: torch.Tensor) -> None:
    """Undo `page_lock` (before the memory is unmapped)."""
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
