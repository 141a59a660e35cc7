"""The kernels a built CUDA library holds, read by the verifier from its own file: what counts as the
candidate's own work on cuda (provenance.py).

A library nvcc built carries its device code in the `.nv_fatbin` section: fatbin containers (magic
0xBA55ED50), each a list of entries, an entry a cubin (an ELF file of device code, kind 2) or PTX
text (kind 1), either of them possibly compressed (zstd, when `zstandard` is importable; an entry
that cannot be read is counted and reported). The names of a cubin's functions (its symbol table)
and a PTX text's entries are the kernels the library can launch, whatever the source called them:
CUB, CUTLASS and ATen's device headers compiled into the candidate's build are its own. Names are
demangled with the same demangler as the profiler's kernel records (`torch._C._demangle`), so the
two compare as text.

Every read is bounded: the file (MAX_FILE_BYTES), the entries (MAX_ENTRIES), a decompressed entry
(MAX_ENTRY_BYTES) and the names (MAX_NAMES).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

MAX_FILE_BYTES = 512 << 20
MAX_ENTRIES = 4096
MAX_ENTRY_BYTES = 256 << 20
MAX_NAMES = 100_000
_FATBIN_MAGIC = 0xBA55ED50
_KIND_PTX, _KIND_ELF = 1, 2
_ZSTD = b"\x28\xb5\x2f\xfd"
_PTX_ENTRY = re.compile(rb"\.entry\s+([A-Za-z_$][\w$]*)")


@dataclass
class DeviceCode:
    """The kernels of one or more libraries: their demangled names, and what could not be read."""

    names: set[str] = field(default_factory=set)
    entries: int = 0
    unreadable: int = 0  # entries compressed in a format this process cannot read, or malformed
    notes: list[str] = field(default_factory=list)

    def add(self, other: DeviceCode) -> None:
        self.names |= other.names
        self.entries += other.entries
        self.unreadable += other.unreadable
        self.notes += other.notes


def device_code(paths: list[str]) -> DeviceCode:
    """The kernels of the built libraries at `paths` (a file without device code adds nothing)."""
    found = DeviceCode()
    for path in paths:
        try:
            found.add(_library(path))
        except (OSError, ValueError, struct.error, IndexError) as err:
            found.notes.append(f"{path.rsplit('/', 1)[-1]}: its device code could not be read ({err})")
    return found


def _library(path: str) -> DeviceCode:
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError("larger than the verifier reads")
    out = DeviceCode()
    for section in _sections(data, ".nv_fatbin"):
        for kind, payload in _entries(section):
            out.entries += 1
            if payload[:4] == _ZSTD:
                payload = _unzstd(payload)
                if payload is None:
                    out.unreadable += 1
                    continue
            if kind == _KIND_ELF and payload[:4] == b"\x7fELF":
                out.names |= _cubin_functions(payload)
            elif kind == _KIND_PTX:
                out.names |= {m.group(1).decode("ascii", "replace") for m in _PTX_ENTRY.finditer(payload)}
            else:
                out.unreadable += 1
            if len(out.names) > MAX_NAMES:
                raise ValueError("more kernels than the verifier reads")
    out.names = {demangle(n) for n in out.names}
    if out.unreadable:
        out.notes.append(f"{out.unreadable} of {out.entries} device code entries could not be read (compressed?)")
    return out


def _sections(data: bytes, wanted: str) -> list[bytes]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if not shoff or shentsize != 64 or shstrndx >= shnum or shoff + shnum * 64 > len(data):
        raise ValueError("no section table")
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * 64) for i in range(shnum)]
    names_at = heads[shstrndx][4]
    found = []
    for name, kind, _flags, _addr, offset, size, *_ in heads:
        end = data.find(b"\0", names_at + name)
        if data[names_at + name : end] == wanted.encode() and kind != 8 and offset + size <= len(data):  # not NOBITS
            found.append(data[offset : offset + size])
    return found


def _entries(section: bytes):
    """(kind, payload) of every entry of every fatbin container in a section."""
    at, count = 0, 0
    while at + 16 <= len(section):
        magic, _version, header, size = struct.unpack_from("<IHHQ", section, at)
        if magic != _FATBIN_MAGIC:
            at += 8  # containers are 8-byte aligned; padding between them
            continue
        entry, end = at + header, min(at + header + size, len(section))
        while entry + 16 <= end:
            kind, _v, entry_header, padded = struct.unpack_from("<HHIQ", section, entry)
            if entry_header < 16 or entry + entry_header + padded > end:
                break
            count += 1
            if count > MAX_ENTRIES:
                raise ValueError("more device code entries than the verifier reads")
            payload_at = entry + entry_header
            yield kind, section[payload_at : payload_at + padded]
            entry = payload_at + padded
        at = max(end, at + 8)


def _cubin_functions(cubin: bytes) -> set[str]:
    """The names of a cubin's functions (STT_FUNC symbols of its symbol table)."""
    if cubin[4] != 2 or cubin[5] != 1:
        return set()
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, _ = struct.unpack_from("<HHH", cubin, 0x3A)
    if not shoff or shentsize != 64 or shoff + shnum * 64 > len(cubin):
        return set()
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * 64) for i in range(shnum)]
    names = set()
    for _n, kind, _f, _a, offset, size, link, _i, _al, _e in heads:
        if kind != 2 or link >= shnum:  # SHT_SYMTAB
            continue
        strtab = heads[link][4]
        for st_name, st_info, _o, st_shndx, _v, _s in struct.iter_unpack("<IBBHQQ", cubin[offset : offset + size]):
            if st_info & 0xF == 2 and st_shndx:  # a defined function
                end = cubin.find(b"\0", strtab + st_name)
                names.add(cubin[strtab + st_name : end].decode("ascii", "replace"))
    return names


def _unzstd(payload: bytes) -> bytes | None:
    try:
        import zstandard
    except ImportError:
        return None
    try:
        return zstandard.ZstdDecompressor().decompress(payload, max_output_size=MAX_ENTRY_BYTES)
    except zstandard.ZstdError:
        return None


def demangle(name: str) -> str:
    """A mangled C++ name as the profiler's kernel records spell it (torch's demangler: the same)."""
    import torch

    try:
        return torch._C._demangle(name)
    except Exception:  # noqa: BLE001 - a name the demangler cannot read stays as it is
        return name
