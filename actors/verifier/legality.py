"""The legality policy: what a candidate may do, and the static half of enforcing it.

The runtime half is the seal (fence.py: the compute fence, the refusers, kiln_native's audit hook),
armed in every process before it loads candidate code. This module owns:
* `ALLOWED_OPS`, the ATen ops a candidate's code may run anywhere: tensor plumbing (allocation,
  views, copies) and random initialisation;
* `Violation`, one finding, with where it happened, as reported in diagnostics and feedback;
* `static_scan(source)`, run in the trusted process before anything is compiled: Python escape
  hatches (patching torch, introspecting the verifier, other compute frameworks, threads, process
  exits, torch.compile, importing the reference) and, in the C++/CUDA strings,
  qualified ATen compute calls, dispatcher bypasses and vendor libraries.
The static scan names the exact construct and line, so its findings double as feedback.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import asdict, dataclass

# ATen ops (overload packet names) that are tensor plumbing. Everything else inside forward is compute.
PLUMBING_OPS = frozenset(
    {
        # allocation
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "empty_permuted",
        "zeros",
        "zeros_like",
        "new_zeros",
        "zero_",
        "ones",
        "ones_like",
        "new_ones",
        "full",
        "full_like",
        "new_full",
        "fill_",
        "scalar_tensor",
        "resize_",
        "lift_fresh",
        # views and shape plumbing
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "permute",
        "transpose",
        "t",
        "expand",
        "expand_as",
        "view_as",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "alias",
        "as_strided",
        "detach",
        "select",
        "slice",
        "narrow",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "movedim",
        "contiguous",
        "_reshape_copy",
        # copies and casts (precision loss is caught by the tolerance check); an RNN's weights packed
        # into one buffer (nn.LSTM/GRU do it when moved to a GPU)
        "clone",
        "copy_",
        "_to_copy",
        "to",
        "_copy_from",
        "_copy_from_and_resize",
        "_cudnn_rnn_flatten_weight",
        # questions about tensors' metadata, not their values (nn.Module.to asks the first)
        "_has_compatible_shallow_copy_type",
        "is_same_size",
        "_has_same_storage_numel",
        # the caching allocator's bookkeeping: a block stays reserved until work on another stream ends
        "record_stream",
    }
)
# Random initialisation: values drawn from scalar parameters, a function of no input. Allowed wherever
# plumbing is (nn.Linear, nn.Conv2d, nn.Embedding initialise their parameters with them in __init__,
# which runs with the fence armed like everything else of the candidate's).
RANDOM_FILLS = frozenset(
    {
        "uniform_",
        "normal_",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "randn",
        "rand",
        "randint",
        "randperm",
        "randn_like",
        "rand_like",
        "randint_like",
        "normal",
    }
)
# Every ATen op a process that loaded candidate code may run; the compute fence refuses the others.
ALLOWED_OPS = PLUMBING_OPS | RANDOM_FILLS


@dataclass(frozen=True)
class Violation:
    kind: str  # forbidden_op, host_roundtrip, introspection, ... (kiln_native, kiln_fence, the runner, static_scan)
    what: str  # the construct: "aten::relu", "torch.allclose", "import numpy"
    where: str = ""  # "line 31: `return torch.relu(x)`" when known
    via: str = ""  # how it was reached: "torch.relu", "native code (C++ extension)"

    def describe(self) -> str:
        text = self.what
        if self.via:
            text += f" (via {self.via})"
        if self.where:
            text += f" at {self.where}"
        return text

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> Violation:
        return Violation(**{k: str(d.get(k, "")) for k in ("kind", "what", "where", "via")})


# --------------------------------------------------------------------------- static scan: Python

# Modules a candidate must not import, with the reason shown in feedback.
FORBIDDEN_MODULES = {
    "numpy": "host compute with numpy",
    "scipy": "host compute with scipy",
    "cupy": "another array library",
    "numba": "another kernel compiler",
    "jax": "another framework",
    "tensorflow": "another framework",
    "ctypes": "raw memory and symbol access",
    "cffi": "raw memory and symbol access",
    "gc": "introspection of the verifier",
    "inspect": "introspection of the verifier",
    "importlib": "dynamic imports",
    "builtins": "patching builtins",
    "sys": None,
    "os": None,
    "subprocess": "spawning processes",
    "multiprocessing": "spawning processes",
    "signal": "signal handlers",
    "threading": "work on threads",
    "_thread": "work on threads",
    "concurrent": "work on threads",
    "asyncio": "work on threads",
    "socket": "network access",
    "urllib": "network access",
    "http": "network access",
    "requests": "network access",
    "pickle": "unpickling",
    "marshal": "code objects",
    "time": None,
    "timeit": "patching the timer",
    "torch._C": "torch internals",
    "torch._dynamo": "torch.compile (compute the gate cannot see)",
    "torch._inductor": "torch.compile (compute the gate cannot see)",
    "torch.jit": "TorchScript fusion (compute the gate cannot see)",
    "torch.fx": "graph rewriting",
    "torch.library": "registering operators",
    "torch.overrides": "torch function overrides",
    "torch.utils._python_dispatch": "dispatch modes",
    "torch.testing": "patching the comparison",
    # Kiln itself: the gate, the clock and the caches are not the candidate's business.
    "actors": "reaching into the verifier",
    "protocols": "reaching into the verifier",
    "configs": "reaching into the verifier",
    "launch": "reaching into the verifier",
}
# Attribute chains that are escape hatches wherever they appear.
FORBIDDEN_ATTRS = {
    "torch.compile": "torch.compile (compute the gate cannot see)",
    "torch.from_numpy": "host round-trip through numpy",
    "sys.modules": "reaching into loaded modules",
    "sys._getframe": "introspection of the verifier",
    "sys.settrace": "tracing hooks",
    "sys.setprofile": "profiling hooks",
    "sys.exit": "exiting the process",
    "sys.addaudithook": "audit hooks",
    "os._exit": "exiting the process",
    "os.kill": "signalling processes",
    "os.killpg": "signalling processes",
    "os.fork": "spawning processes",
    "os.system": "spawning processes",
    "os.popen": "spawning processes",
    "os.execv": "spawning processes",
    "os.execvp": "spawning processes",
    "os.abort": "exiting the process",
}
FORBIDDEN_CALLS = {
    "exec": "dynamic code",
    "eval": "dynamic code",
    "compile": "dynamic code",
    "__import__": "dynamic imports",
    "globals": "reaching into module globals",
    "vars": "reaching into objects",
    "exit": "exiting the process",
    "quit": "exiting the process",
    "breakpoint": "debugger hooks",
}
FORBIDDEN_METHODS = {
    "numpy": "host round-trip through numpy",
    "tolist": "host round-trip through Python lists",
    "__array__": "host round-trip through numpy",
    "apply_": "Python compute over tensor elements",
    "map_": "Python compute over tensor elements",
    "map2_": "Python compute over tensor elements",
    "redispatch": "calling a kernel below the dispatcher",
    "_disable_current_modes": "switching off dispatch modes",
    "_pop_mode": "switching off dispatch modes",
    "_pop_mode_temporarily": "switching off dispatch modes",
    "__dlpack__": "host round-trip through DLPack",
}
_REFERENCE_IMPORT = re.compile(r"(^|\.)(level\d+|reference|references|kernelbench|tasks)(\.|$)", re.IGNORECASE)
_TORCH_ROOTS = ("torch", "time", "sys", "os", "builtins", "math")


def static_scan(source: str, *, allow_vendor_libs: bool = True) -> tuple[list[Violation], list[str]]:
    """(violations, vendor libraries used) for a candidate's source. Never raises on valid Python."""
    from protocols.pyparse import parse_python  # here: the sandbox imports this module, not the scan

    tree = parse_python(source)
    lines = source.splitlines()
    aliases = _module_aliases(tree)
    found: list[Violation] = []

    def where(node) -> str:
        n = getattr(node, "lineno", 0)
        text = lines[n - 1].strip() if 0 < n <= len(lines) else ""
        return f"line {n}: `{text[:120]}`" if text else f"line {n}"

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += _check_import(node, where(node))
        elif isinstance(node, ast.Attribute):
            chain = _resolve(node, aliases)
            if chain in FORBIDDEN_ATTRS:
                found.append(Violation("static", chain, where(node), FORBIDDEN_ATTRS[chain]))
            elif chain.startswith(("torch._C", "torch._dynamo", "torch._inductor")):
                found.append(Violation("static", chain, where(node), "torch internals"))
            elif node.attr in FORBIDDEN_METHODS and isinstance(getattr(node, "ctx", None), ast.Load):
                found.append(Violation("static", f".{node.attr}()", where(node), FORBIDDEN_METHODS[node.attr]))
            elif node.attr in (
                "__torch_function__",
                "__torch_dispatch__",
                "__code__",
                "__globals__",
                "__closure__",
                "__subclasses__",
                "__builtins__",
            ):
                found.append(Violation("static", node.attr, where(node), "interpreter internals"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(Violation("static", f"{node.func.id}()", where(node), FORBIDDEN_CALLS[node.func.id]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            target = _resolve(node.args[0], aliases) if node.args else ""
            if target.split(".")[0] in _TORCH_ROOTS:
                found.append(Violation("static", f"{node.func.id}({target}, ...)", where(node), "patching a library"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                owner = _resolve(t.value, aliases) if isinstance(t, ast.Attribute) else ""
                if owner.split(".")[0] in _TORCH_ROOTS and not owner.startswith("torch.backends"):
                    found.append(
                        Violation("static", f"assignment to {_resolve(t, aliases)}", where(node), "patching a library")
                    )
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
            "__torch_function__",
            "__torch_dispatch__",
        ):
            found.append(Violation("static", f"def {node.name}", where(node), "tensor subclass / override"))
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                if _resolve(base, aliases) in ("torch.Tensor", "torch._C.TensorBase", "torch.nn.Parameter"):
                    found.append(
                        Violation(
                            "static", f"class {node.name}({_resolve(base, aliases)})", where(node), "tensor subclass"
                        )
                    )
    for text in _string_constants(tree):  # getattr(x, "apply_"), importlib-free module names
        if text.isidentifier() and text in FORBIDDEN_METHODS:
            found.append(Violation("static", f"'{text}'", "", FORBIDDEN_METHODS[text]))
    native = "\n".join(_string_constants(tree))
    found += native_scan(native)
    vendors = vendor_libraries(native)
    if vendors and not allow_vendor_libs:
        found.append(
            Violation(
                "vendor_lib",
                ", ".join(vendors),
                "",
                "vendor libraries are switched off (verifier.legality.allow_vendor_libs)",
            )
        )
    return _dedupe(found), vendors


def _check_import(node, where: str) -> list[Violation]:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return [
                Violation(
                    "static",
                    f"relative import from {'.' * node.level}{node.module or ''}",
                    where,
                    "importing the reference",
                )
            ]
        names += [f"{node.module}.{a.name}" for a in node.names]
    out = []
    for name in names:
        if _REFERENCE_IMPORT.search(name):
            out.append(Violation("static", f"import {name}", where, "importing the reference"))
            continue
        for mod, reason in FORBIDDEN_MODULES.items():
            if reason and (name == mod or name.startswith(mod + ".")):
                out.append(Violation("static", f"import {name}", where, reason))
                break
        if isinstance(node, ast.ImportFrom) and node.module in ("sys", "os", "time", "torch"):
            for a in node.names:
                chain = f"{node.module}.{a.name}"
                if chain in FORBIDDEN_ATTRS:
                    out.append(
                        Violation("static", f"from {node.module} import {a.name}", where, FORBIDDEN_ATTRS[chain])
                    )
    return out


def _module_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted module/attribute it stands for (`import torch.nn.functional as F`)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _resolve(node, aliases: dict[str, str]) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(aliases.get(node.id, node.id))
    else:
        return ""
    return ".".join(reversed(parts))


def _string_constants(tree: ast.Module) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _dedupe(items: list[Violation]) -> list[Violation]:
    seen, out = set(), []
    for v in items:
        key = (v.kind, v.what, v.where)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


# ------------------------------------------------------------------------- static scan: native code

# Qualified at::/torch:: names that are types, allocation, device/stream plumbing or utilities.
NATIVE_ALLOWED_ROOTS = frozenset(
    {
        "Tensor",
        "TensorOptions",
        "TensorAccessor",
        "PackedTensorAccessor",
        "PackedTensorAccessor32",
        "PackedTensorAccessor64",
        "GenericPackedTensorAccessor",
        "RestrictPtrTraits",
        "DefaultPtrTraits",
        "ScalarType",
        "Scalar",
        "IntArrayRef",
        "ArrayRef",
        "Device",
        "DeviceType",
        "DeviceGuard",
        "OptionalDeviceGuard",
        "Layout",
        "MemoryFormat",
        "Half",
        "BFloat16",
        "optional",
        "nullopt",
        "empty",
        "empty_like",
        "empty_strided",
        "zeros",
        "zeros_like",
        "ones",
        "ones_like",
        "full",
        "full_like",
        "from_blob",
        "cuda",
        "parallel_for",
        "get_num_threads",
        "in_parallel_region",
        "get_thread_num",
        "elementSize",
        "toString",
        "Dtype",
        "dtype",
        "device",
        "indexing",
        "acc_type",
        "opmath_type",
        "numeric_limits",
        "NoGradGuard",
        "InferenceMode",
    }
)
_NATIVE_CONSTANT = re.compile(r"k[A-Z]\w*$")  # at::kFloat, torch::kCUDA, ...
_NATIVE_NAME = re.compile(r"\b(?:at|torch)::((?:\w+::)*\w+)")
# Dispatcher bypasses: excluding the Python dispatch key hides ATen calls from the runtime gate.
_NATIVE_BYPASS = re.compile(
    r"\b(ExcludeDispatchKeyGuard|IncludeDispatchKeyGuard|DispatchKeySet|DispatchKey::|AutoDispatchBelow\w*|"
    r"AutoNonVariableTypeMode|_AutoDispatchBelow\w*|Dispatcher::singleton|findSchema|callBoxed|"
    r"PythonDispatcherTLS|tls_set_dispatch_key)"
)
_VENDORS = {
    "cuBLAS": re.compile(r"\bcublas\w*|getCurrentCUDABlasHandle"),
    "cuDNN": re.compile(r"\bcudnn\w*"),
    "CUTLASS": re.compile(r"\bcutlass::|<cutlass/|\bcute::"),
    "cuSPARSE": re.compile(r"\bcusparse\w*\s*\("),
    "cuFFT": re.compile(r"\bcufft\w*\s*\("),
    "BLAS (CPU)": re.compile(r"\bcblas_\w+|\bsgemm_\s*\(|\bdgemm_\s*\("),
    "MKL/oneDNN": re.compile(r"\bmkl_\w+\s*\(|\bdnnl::|\bdnnl_\w+\s*\("),
}


def native_scan(native: str) -> list[Violation]:
    """What the C++/CUDA sources certainly call of ATen's compute, for early feedback with the line:
    an op outside ALLOWED_OPS named at the top of at:: or torch:: (`at::relu`, `torch::clamp_min`), or
    anything in a namespace of operator calls (`at::_ops`, `at::redispatch`). A name deeper in another
    namespace may be header-only code compiled into the candidate's own library (`at::vec::exp` on a
    Vectorized<float>, `at::native::` device helpers), so it is left to the check of what the built
    library imports (build/symbols.py), which decides."""
    out = []
    ops = _aten_ops()
    for m in _NATIVE_NAME.finditer(native):
        parts = m.group(1).split("::")
        root = parts[0]
        if root in NATIVE_ALLOWED_ROOTS or _NATIVE_CONSTANT.match(root):
            continue
        kernel_namespace = root in _KERNEL_NAMESPACES and len(parts) > 1
        top_level_op = len(parts) == 1 and root in ops and root not in ALLOWED_OPS
        if kernel_namespace or top_level_op:
            out.append(
                Violation(
                    "native_op",
                    m.group(0),
                    _native_line(native, m.start()),
                    "ATen compute called from C++ (write the computation in your kernel)",
                )
            )
    for m in _NATIVE_BYPASS.finditer(native):
        out.append(
            Violation("native_bypass", m.group(1), _native_line(native, m.start()), "bypassing the ATen dispatcher")
        )
    return out


# at::/torch:: namespaces whose every name is a call into an operator. at::native, at::cpu and their kin
# also hold header-only code (device helpers, loops, vector types) that compiles into the candidate's
# own library, so they are left to the check of what the built library imports (build/symbols.py).
_KERNEL_NAMESPACES = frozenset({"_ops", "redispatch"})


@functools.lru_cache(maxsize=1)
def _aten_ops() -> frozenset[str]:
    import torch

    return frozenset(
        n[len("aten::") :].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")
    )


def vendor_libraries(native: str) -> list[str]:
    return sorted(name for name, pattern in _VENDORS.items() if pattern.search(native))


def _native_line(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start : end if end >= 0 else len(text)].strip()
    return f"C++ `{line[:120]}`"
