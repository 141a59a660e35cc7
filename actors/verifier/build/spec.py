"""What a candidate asked to build: one `ExtensionSpec` per `load_inline(...)` call.

The same normalisation runs at capture time (compile child) and at run time (`install_prebuilt` in
the execution worker), so both sides compute the same cache key for the same call. A call with an
argument the verifier cannot honour (SYCL sources, `is_python_module=False`) raises
`UnsupportedCall` with a message the model can act on.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import asdict, dataclass
from typing import Any

# Bump when anything that shapes a built artifact changes (preludes, flags, binding text, the
# metadata an artifact carries: kiln-build-2 records the symbol check of every built library).
PIPELINE_VERSION = "kiln-build-2"
from .symbols import RULES_VERSION  # a change of the rules re-checks every build

# Flags that load code into the compiler or linker, run another program, or read the flags from a
# file: a candidate's extra_*flags never carry them (the compilers run jailed anyway).
_CODE_LOADING_FLAG = re.compile(
    r"^(-fplugin|-wrapper|-B|-specs|--specs|@|-fuse-ld=/|--plugin|-plugin|-ccbin|--compiler-bindir|"
    r"--dependency-drive|-Xclang|--sysroot|-isysroot|-fprofile-use|-fauto-profile)"
)
_LINKER_OPTION = re.compile(r"(^|,)(--plugin|-plugin|--audit|--depaudit|-P|--dynamic-linker|-dynamic-linker)(=|,|$)")


class UnsupportedCall(ValueError):
    """A load_inline argument the verifier does not support."""


@dataclass(frozen=True)
class ExtensionSpec:
    """One captured `torch.utils.cpp_extension.load_inline(...)` call, normalised."""

    name: str
    cpp_sources: tuple[str, ...]
    cuda_sources: tuple[str, ...]
    functions: tuple[str, ...]  # load_inline's `functions` (list, or dict keys)
    extra_cflags: tuple[str, ...]
    extra_cuda_cflags: tuple[str, ...]
    extra_ldflags: tuple[str, ...]
    extra_include_paths: tuple[str, ...]
    with_cuda: bool
    docstrings: tuple[str, ...] = ()  # aligned with `functions` (the dict values; names for a list)
    with_pytorch_error_handling: bool = True
    no_implicit_headers: bool = False
    has_functions: bool = True  # False when load_inline got functions=None (user-written PYBIND11_MODULE)

    def key(self, toolchain: str) -> str:
        """Content hash of everything that shapes the built .so, plus the toolchain id."""
        blob = json.dumps(
            {"spec": asdict(self), "toolchain": toolchain, "v": PIPELINE_VERSION, "rules": RULES_VERSION},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ExtensionSpec:
        """Rebuild from `to_dict()` output; raises ValueError on anything malformed."""
        if not isinstance(d, dict):
            # from_dict's contract: ValueError on anything malformed
            raise ValueError("spec must be a dict")  # noqa: TRY004
        fields = {}
        for f in cls.__dataclass_fields__.values():
            if f.name not in d:
                raise ValueError(f"spec misses field {f.name!r}")
            v = d[f.name]
            if f.type.startswith("tuple"):
                if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
                    raise ValueError(f"spec field {f.name!r} must be a list of strings")
                v = tuple(v)
            elif f.type == "bool":
                if not isinstance(v, bool):
                    raise ValueError(f"spec field {f.name!r} must be a bool")
            elif not isinstance(v, str):
                raise ValueError(f"spec field {f.name!r} must be a string")
            fields[f.name] = v
        return cls(**fields)


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        return tuple(value)
    raise UnsupportedCall(f"load_inline: {what} must be a string or a list of strings")


def spec_from_call(
    name,
    cpp_sources,
    cuda_sources=None,
    sycl_sources=None,
    functions=None,
    extra_cflags=None,
    extra_cuda_cflags=None,
    extra_sycl_cflags=None,
    extra_ldflags=None,
    extra_include_paths=None,
    build_directory=None,
    verbose=False,
    with_cuda=None,
    with_sycl=None,
    is_python_module=True,
    with_pytorch_error_handling=True,
    keep_intermediates=True,
    use_pch=False,
    no_implicit_headers=False,
) -> ExtensionSpec:
    """Normalise load_inline's arguments (same signature as torch's) into an ExtensionSpec.

    Arguments that only steer torch's own build (build_directory, verbose, keep_intermediates,
    use_pch) are accepted and ignored: the verifier builds its own way.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise UnsupportedCall("load_inline: name must be a valid identifier (it names the Python module)")
    if sycl_sources or extra_sycl_cflags or with_sycl:
        raise UnsupportedCall("load_inline: SYCL sources are not supported by this verifier")
    if not is_python_module:
        raise UnsupportedCall(
            "load_inline: is_python_module=False is not supported; bind functions with `functions=[...]` instead"
        )
    if functions is None:
        names, docs = (), ()
    elif isinstance(functions, str):
        names, docs = (functions,), (functions,)
    elif isinstance(functions, dict):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in functions.items()):
            raise UnsupportedCall("load_inline: functions dict must map names to docstrings")
        names, docs = tuple(functions), tuple(functions.values())
    elif isinstance(functions, (list, tuple)) and all(isinstance(f, str) for f in functions):
        names, docs = tuple(functions), tuple(functions)
    else:
        raise UnsupportedCall("load_inline: functions must be a list of names or a dict")
    cuda = _strings(cuda_sources, "cuda_sources")
    spec = ExtensionSpec(
        name=name,
        cpp_sources=_strings(cpp_sources, "cpp_sources"),
        cuda_sources=cuda,
        functions=names,
        docstrings=docs,
        extra_cflags=tuple(f.strip() for f in _strings(extra_cflags, "extra_cflags")),
        extra_cuda_cflags=tuple(f.strip() for f in _strings(extra_cuda_cflags, "extra_cuda_cflags")),
        extra_ldflags=tuple(f.strip() for f in _strings(extra_ldflags, "extra_ldflags")),
        extra_include_paths=tuple(p.strip() for p in _strings(extra_include_paths, "extra_include_paths")),
        with_cuda=bool(cuda) if with_cuda is None else bool(with_cuda),
        with_pytorch_error_handling=bool(with_pytorch_error_handling),
        no_implicit_headers=bool(no_implicit_headers),
        has_functions=functions is not None,
    )
    check_flags(spec)
    return spec


MAX_FLAG_CHARS = 4096  # one entry of extra_cflags / extra_cuda_cflags / extra_ldflags


def check_flags(spec: ExtensionSpec) -> None:
    """Refuse flags that make a compiler or the linker load or run other code (UnsupportedCall), and
    entries longer than MAX_FLAG_CHARS before they are parsed (shlex takes time quadratic in a token's
    length: a megabyte-long flag would hold the service's thread for minutes)."""
    for field_name in ("extra_cflags", "extra_cuda_cflags", "extra_ldflags"):
        for text in getattr(spec, field_name):
            if len(text) > MAX_FLAG_CHARS:
                raise UnsupportedCall(
                    f"load_inline: an {field_name} entry of {len(text)} characters (at most {MAX_FLAG_CHARS})"
                )
            try:
                parts = shlex.split(text)
            except ValueError:
                raise UnsupportedCall(f"load_inline: {field_name} entry {text!r} does not parse as flags") from None
            for i, flag in enumerate(parts):
                inner = [flag]
                if flag.startswith(("-Wl,", "-Xlinker", "--linker-options", "-Xcompiler", "--compiler-options")):
                    inner = flag.split(",")[1:] or parts[i + 1 : i + 2]
                    inner = [x for y in inner for x in y.split(",")]
                for f in inner:
                    if _CODE_LOADING_FLAG.match(f) or _LINKER_OPTION.search(f):
                        raise UnsupportedCall(
                            f"load_inline: the flag {flag!r} in {field_name} is not allowed "
                            "(it loads or runs other code in the compiler or linker)"
                        )
