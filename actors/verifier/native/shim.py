"""Keeping raw memory out of the zygote's interpreter: a stand-in for ctypes, and modules refused.

Every process that runs candidate code is forked from the zygote, so whatever the zygote's
interpreter has loaded, the candidate's Python can reach: once a module is loaded, its classes are
found through `object.__subclasses__()` even when no name refers to it. ctypes is the decisive one
(a `Union` of an integer and a pointer reads and writes any address, with no audit event), and
torch imports it at start-up to load its libraries. So before the zygote imports torch:

* `ctypes` is this stand-in. It can load a library (`CDLL`, through kiln_native.dlopen, which is
  what torch needs from it at import) and offers names that torch's modules take at import time,
  but it has no foreign-function or memory machinery at all: `_ctypes` is never loaded.
* the modules of `native.DENIED_IMPORTS` (numpy among them: torch works without it) are refused,
  as if absent, so torch takes its numpy-less paths.
Once a sandbox is armed, kiln_native's audit hook refuses those imports again, and the jail hides
their files: the stand-in only has to hold while the zygote starts.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

from actors.verifier.native import DENIED_IMPORTS


class _WithoutDenied(importlib.abc.MetaPathFinder):
    """The path finder, except that a denied module is not there (`find_spec` says None, as for a
    module that is not installed, so torch takes its paths for an absent numpy)."""

    def __init__(self, finder) -> None:
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in DENIED_IMPORTS:
            return None
        return self.finder.find_spec(name, path, target)

    def invalidate_caches(self) -> None:
        self.finder.invalidate_caches()


class _Placeholder:
    """What a ctypes type or function is here: constructible, never callable into native code."""

    def __init__(self, *args, **kwargs) -> None:
        self.value = args[0] if args else None

    native = None  # kiln_native, set by `install`

    def __call__(self, *args, **kwargs):
        if self.native is not None and self.native.armed():
            self.native.refuser("a ctypes foreign function", "native_escape", "raw memory and foreign calls")()
        raise OSError("foreign functions are not available in the verifier's sandbox")


# Sizes of the C scalar types on x86-64 / aarch64 Linux (LP64), for `sizeof`.
_SIZES = {
    "c_bool": 1,
    "c_char": 1,
    "c_byte": 1,
    "c_ubyte": 1,
    "c_short": 2,
    "c_ushort": 2,
    "c_int": 4,
    "c_uint": 4,
    "c_long": 8,
    "c_ulong": 8,
    "c_longlong": 8,
    "c_ulonglong": 8,
    "c_size_t": 8,
    "c_ssize_t": 8,
    "c_float": 4,
    "c_double": 8,
    "c_longdouble": 16,
    "c_void_p": 8,
    "c_char_p": 8,
    "c_wchar_p": 8,
    "c_int8": 1,
    "c_uint8": 1,
    "c_int16": 2,
    "c_uint16": 2,
    "c_int32": 4,
    "c_uint32": 4,
    "c_int64": 8,
    "c_uint64": 8,
    "c_wchar": 4,
}


# ctypes' public names, so that a star import of the stand-in defines them: types (placeholders that
# torch's modules may subclass or size at import) and functions that would touch raw memory or call
# foreign code (they raise).
_NAMES = tuple(_SIZES) + (
    "POINTER",
    "CFUNCTYPE",
    "PYFUNCTYPE",
    "Structure",
    "Union",
    "Array",
    "BigEndianStructure",
    "LittleEndianStructure",
    "cdll",
    "pydll",
    "ArgumentError",
    "LibraryLoader",
    "DEFAULT_MODE",
    "py_object",
    "HRESULT",
)
_RAW = (
    "pointer",
    "byref",
    "cast",
    "addressof",
    "memmove",
    "memset",
    "string_at",
    "wstring_at",
    "c_buffer",
    "create_string_buffer",
    "create_unicode_buffer",
    "resize",
    "SetPointerType",
    "get_errno",
    "set_errno",
    "alignment",
    "pythonapi",
)


def _stand_in(native) -> tuple[types.ModuleType, types.ModuleType]:
    module = types.ModuleType("ctypes", "Kiln's sandbox stand-in for ctypes: loads libraries, nothing else.")
    module.__path__ = []  # a package, so `import ctypes.util` finds its submodule in sys.modules

    class CDLL:
        def __init__(
            self, name, mode=os.RTLD_LOCAL, handle=None, use_errno=False, use_last_error=False, winmode=None
        ) -> None:
            self._name = name
            self._handle = handle if handle is not None else native.dlopen(name, mode | os.RTLD_NOW)

        def __getattr__(self, name):
            # Before arming (torch's import probing a library) a symbol is simply not there; once
            # candidate code exists, asking for one is an attempt at a foreign call, and evidence.
            if native.armed():
                native.refuser(f"ctypes symbol {name}", "native_escape", "raw memory and foreign calls")()
            raise AttributeError(f"{self._name}.{name}: foreign functions are not available in the verifier's sandbox")

    module.CDLL = module.PyDLL = CDLL
    module.RTLD_GLOBAL, module.RTLD_LOCAL = os.RTLD_GLOBAL, os.RTLD_LOCAL

    def placeholder(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Placeholder,), {"_size": _SIZES.get(name, 8)})

    def sizeof(obj) -> int:  # modules size their integer types at import (sympy: sizeof(c_long))
        size = getattr(obj, "_size", None)
        if not isinstance(size, int):
            raise TypeError("sizeof: only the stand-in's scalar types have a size here")
        return size

    module.__getattr__ = placeholder
    module.sizeof = sizeof
    for name in _NAMES:  # `from ctypes import *` takes what the module holds, not what __getattr__ makes
        if not hasattr(module, name):
            setattr(module, name, placeholder(name))
    for name in _RAW:  # calling one is an attempt at raw memory: refused, with evidence once armed
        setattr(module, name, native.refuser(f"ctypes.{name}", "native_escape", "raw memory and foreign calls"))
    module.__all__ = sorted(set(_NAMES) | set(_RAW) | {"CDLL", "PyDLL", "RTLD_GLOBAL", "RTLD_LOCAL", "sizeof"})
    util = types.ModuleType("ctypes.util")
    util.find_library = lambda name: None
    module.util = util
    return module, util


def install(native) -> None:
    """In the zygote, before torch: the ctypes stand-in and the refused modules."""
    if "_ctypes" in sys.modules:
        raise RuntimeError("ctypes is already loaded: the zygote must install the stand-in before anything imports it")
    _Placeholder.native = native
    module, util = _stand_in(native)
    sys.modules["ctypes"] = module
    sys.modules["ctypes.util"] = util
    sys.meta_path[:] = [_WithoutDenied(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]


def lift() -> None:
    """In a forked child that will run no candidate code and is never sealed (a jailed reference's
    process): ctypes and the refused modules importable again, the real ones. Whatever imported the
    stand-in keeps it; later imports get the real module."""
    sys.meta_path[:] = [f.finder if isinstance(f, _WithoutDenied) else f for f in sys.meta_path]
    if "_ctypes" not in sys.modules:  # what sys.modules holds under these names is the stand-in
        sys.modules.pop("ctypes", None)
        sys.modules.pop("ctypes.util", None)
