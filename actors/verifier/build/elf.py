"""What a shared library imports and exports, read from its ELF file: the dynamic symbols (defined
and undefined), the libraries it needs (DT_NEEDED), its search paths (RPATH/RUNPATH) and the rtld
audit and filter entries a loader would honour. The symbol check (symbols.py) judges what is read here.

The file is read section by section with `pread`, never whole, and a candidate's library (`limited`)
within fixed bounds: a table larger than a bound, or names longer than one, make it unreadable
(`ElfError`) before anything that size is allocated. torch's own libraries are read whole.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

MAX_ELF_BYTES = 512 << 20  # a candidate's library (the service refuses larger ones before this)
# Bounds on reading a candidate's library (torch's own are read whole): honest extensions have a few
# thousand dynamic symbols and well under a megabyte of names.
MAX_SECTIONS = 4096
MAX_SYMBOLS = 100_000
MAX_STRTAB = 16 << 20
MAX_NAME = 4096
MAX_NAME_BYTES = 32 << 20
MAX_DYNAMIC = 4096
_DT_NEEDED, _DT_RPATH, _DT_RUNPATH = 1, 15, 29
_DT_SUSPICIOUS = {
    0x6FFFFEFB: "DT_AUDIT",
    0x6FFFFEFC: "DT_DEPAUDIT",
    0x7FFFFFFD: "DT_AUXILIARY",
    0x7FFFFFFF: "DT_FILTER",
}


@dataclass
class ElfImports:
    undefined: list[str] = field(default_factory=list)  # undefined dynamic symbols (mangled)
    defined: list[str] = field(default_factory=list)
    needed: list[str] = field(default_factory=list)  # DT_NEEDED
    search_paths: list[str] = field(default_factory=list)  # RPATH/RUNPATH entries
    suspicious: list[str] = field(default_factory=list)  # DT_AUDIT and friends


class ElfError(ValueError):
    """The file is not an ELF shared library this checker can read."""


def read_imports(path: str, limited: bool = False) -> ElfImports:
    """The dynamic imports of the ELF file at `path`, read section by section (never the whole
    file). `limited` (a candidate's library): at most MAX_SYMBOLS dynamic symbols, MAX_NAME_BYTES of
    their names together, MAX_SECTIONS sections, each name cut at MAX_NAME; past a bound the library
    is unreadable (ElfError), before anything larger is read. torch's own libraries are read whole."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if limited and size > MAX_ELF_BYTES:
            raise ElfError("the built library is larger than the checker reads")
        head = _pread(f, 0, 64, size)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ElfError("not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, _ = struct.unpack_from("<HHH", head, 0x3A)
        if shoff == 0 or shnum == 0 or shentsize != 64 or shoff + shnum * 64 > size:
            raise ElfError("the built library has no section table")
        if limited and shnum > MAX_SECTIONS:
            raise ElfError(f"the built library has {shnum} sections; the checker reads at most {MAX_SECTIONS}")
        table = _pread(f, shoff, shnum * 64, size)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * 64) for i in range(shnum)]
        names = _Names(f, size, limited)
        out = ElfImports()
        seen_dynsym = False
        for _name, kind, _, _, offset, length, link, _, _, _entsize in sections:
            if kind == 11:  # SHT_DYNSYM
                seen_dynsym = True
                count = length // 24
                if limited and count > MAX_SYMBOLS:
                    raise ElfError(
                        f"the built library has {count} dynamic symbols; the checker reads at most {MAX_SYMBOLS}"
                    )
                strtab = names.table(sections, link)
                data = _pread(f, offset, count * 24, size)
                for off in range(24, count * 24, 24):  # entry 0 is the null symbol
                    st_name, _st_info, _, st_shndx, _, _ = struct.unpack_from("<IBBHQQ", data, off)
                    sym = names.get(strtab, st_name)
                    if sym:
                        (out.undefined if st_shndx == 0 else out.defined).append(sym)
            elif kind == 6:  # SHT_DYNAMIC
                strtab = names.table(sections, link)
                count = min(length // 16, MAX_DYNAMIC) if limited else length // 16
                data = _pread(f, offset, count * 16, size)
                for off in range(0, count * 16, 16):
                    tag, val = struct.unpack_from("<qQ", data, off)
                    if tag == 0:
                        break
                    if tag == _DT_NEEDED:
                        out.needed.append(names.get(strtab, val))
                    elif tag in (_DT_RPATH, _DT_RUNPATH):
                        out.search_paths += [p for p in names.get(strtab, val).split(":") if p]
                    elif tag & 0xFFFFFFFF in _DT_SUSPICIOUS:
                        out.suspicious.append(_DT_SUSPICIOUS[tag & 0xFFFFFFFF])
    if not seen_dynsym:
        raise ElfError("the built library has no dynamic symbol table")
    return out


def _pread(f, offset: int, length: int, size: int) -> bytes:
    """`length` bytes at `offset`, checked against the file's size before anything is allocated."""
    if offset < 0 or length < 0 or offset + length > size:
        raise ElfError("the built library's tables point outside the file")
    return os.pread(f.fileno(), length, offset)


class _Names:
    """Names out of a library's string tables: each table read once (at most MAX_STRTAB bytes for a
    candidate's library), each name cut at MAX_NAME, and all the names decoded together at most
    MAX_NAME_BYTES (a table whose every offset is a long name must not cost its square)."""

    def __init__(self, f, size: int, limited: bool) -> None:
        self.f, self.size, self.limited = f, size, limited
        self.tables: dict[int, bytes] = {}
        self.decoded = 0

    def table(self, sections: list, index: int) -> bytes:
        if index >= len(sections):
            raise ElfError("the built library's symbols name a string table it does not have")
        if index not in self.tables:
            offset, length = sections[index][4], sections[index][5]
            if self.limited and length > MAX_STRTAB:
                raise ElfError(
                    f"the built library's string table is {length >> 20} MB; the checker reads at most {MAX_STRTAB >> 20}"
                )
            self.tables[index] = _pread(self.f, offset, length, self.size)
        return self.tables[index]

    def get(self, data: bytes, off: int) -> str:
        end = data.find(b"\0", off, off + MAX_NAME) if off < len(data) else -1
        name = data[off : end if end >= 0 else min(len(data), off + MAX_NAME)]
        self.decoded += len(name)
        if self.limited and self.decoded > MAX_NAME_BYTES:
            raise ElfError(f"the built library's symbol names exceed {MAX_NAME_BYTES >> 20} MB")
        return name.decode("ascii", "replace")
