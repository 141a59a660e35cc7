"""Importing built extensions, and `install_prebuilt` for the execution worker.

The execution worker must never compile (the GPU would wait on nvcc): before it imports a
candidate, `install_prebuilt(result.artifacts, result.toolchain)` replaces load_inline with a
loader that computes the call's spec key and imports the .so the compile stage built for it.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

from .spec import UnsupportedCall, spec_from_call


class PrebuiltMissing(RuntimeError):
    """load_inline was called with arguments the compile stage did not see."""


def import_extension(so_path: str | Path) -> ModuleType:
    """Import a built extension .so (its init function is named after the file's stem).

    The module's import name is `kiln_<hash of the path>.<stem>`: Python finds `PyInit_<stem>`
    from the last part, and pybind11, which caches initialised modules by that name, keeps two
    extensions apart. Every split build is a `kiln_ext.so`, so under the bare stem the second
    extension a candidate loads would come back as the first one's module."""
    path = Path(so_path).resolve()
    name = f"kiln_{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.{path.stem}"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refuse_load(*args, **kwargs):
    raise UnsupportedCall(
        "torch.utils.cpp_extension.load(...) (building from files) is not supported "
        "by the verifier: pass the sources as strings to load_inline(...)"
    )


def install_prebuilt(artifacts: dict[str, str], toolchain: str) -> None:
    """Make load_inline import prebuilt artifacts (spec key -> .so path) instead of compiling.

    Patches `torch.utils.cpp_extension.load_inline` (so `from torch.utils.cpp_extension import
    load_inline`, executed afterwards, gets the loader too) and refuses `cpp_extension.load`.
    A call whose key is not in `artifacts` raises PrebuiltMissing: the candidate builds something
    at run time that differs from what it built at capture time, which is suspicious.
    """
    from torch.utils import cpp_extension

    table = dict(artifacts)
    loaded: dict[str, ModuleType] = {}

    def load_inline(*args, **kwargs):
        spec = spec_from_call(*args, **kwargs)
        key = spec.key(toolchain)
        if key not in table:
            raise PrebuiltMissing(
                f"load_inline(name={spec.name!r}) was called with sources or flags the compile stage did not "
                f"build (key {key[:12]}; built: {sorted(k[:12] for k in table) or 'none'}). Call load_inline at "
                f"module level with fixed arguments; building differently at run time is not allowed."
            )
        if key not in loaded:
            loaded[key] = import_extension(table[key])
        return loaded[key]

    cpp_extension.load_inline = load_inline
    cpp_extension.load = refuse_load
