"""Build one ExtensionSpec into an importable .so, fast, and cache it by content.

Plan (load_inline semantics, faster shape):
* split (the usual case): the bound functions' declarations are read from cpp_sources
  (`cxx_scan.bound_declarations`), so the binding becomes its own TU generated from the
  signatures alone and cached by signature hash. It is a thunk TU (`thunks.py`: ~1 s, linked with
  the toolchain's prebuilt pybind11 module shell) when the signature's types allow, else a
  generated pybind11 TU (~5 s): either way most candidates never compile pybind11. The
  candidate's C++ (when it holds more than those declarations) and CUDA code are compiled against
  the lean prelude; a lean unit whose first error is a missing name/overload is recompiled against
  load_inline's full headers, and only then are errors reported. A CUDA unit whose C++ side is the
  declarations alone is tried first against the facade (facade.py: no torch header in nvcc's TU),
  with a facade thunk binding; when either does not compile, both are redone the lean way.
* monolithic: when the declarations cannot be read with confidence (templates, macros, overloads,
  user-written pybind11 code, no_implicit_headers), one main TU exactly as load_inline writes it,
  against the precompiled full prelude; a binding unit that fails to compile also lands here.
All units of one extension compile concurrently (a CUDA unit's host and device front ends too,
see `nvcc.py`), then one g++ link against torch's libraries.
`compile()` runs in a jailed build process (worker.py) and writes only into its build directory;
it reads cached binding objects and precompiled headers. Publishing into the cache (after the
symbol check) is the trusted service's job (service.py), so nothing a compiler does can reach it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import cxx_scan, diagnostics, facade, nvcc, thunks
from .cache import ArtifactCache
from .plan import Plan, Unit
from .preludes import FACADE_LIB, SHELL, PchStore, flag_profile
from .spec import ExtensionSpec
from .toolchain import Toolchain

SPLIT_MODULE = "kiln_ext"  # module name of split builds: the shared binding cannot carry the user's
# The binding is pybind11 dispatch glue: -O1 compiles ~35% faster than -O2 and measured the same
# per-call overhead (~0.3 us) on this machine.
BINDING_OPT = ("-O1",)


class CompileFailed(Exception):
    """The extension did not build. `message` is user-facing; `infra` marks machine failures."""

    def __init__(self, message: str, *, infra: bool = False, phases: dict | None = None, unit: str = ""):
        super().__init__(message)
        self.message = message
        self.infra = infra
        self.phases = phases or {}
        self.unit = unit


@dataclass
class Built:
    key: str
    so_path: str
    prelude: str  # how it was built: "lean", "full", "lean->full", "monolithic", ... ("cache" on a hit)
    phases: dict[str, float]
    vendor_libs: list[str]
    cached: bool
    notes: list[str] = field(default_factory=list)
    pch_wanted: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    binding: tuple[str, str] | None = None  # (binding key, object file in the build dir) to publish


def _compiler_env() -> dict[str, str]:
    # LC_ALL=C: plain ASCII quotes in diagnostics, whatever the locale.
    return {**os.environ, "LC_ALL": "C"}


def _split_flags(flags: tuple[str, ...]) -> list[str]:
    # torch writes flags into a ninja file run by the shell, so "-O3 -march=native" is two flags.
    out = []
    for f in flags:
        out += shlex.split(f)
    return out


def _user_file_names(kind: str, n: int) -> list[str]:
    return [kind] if n == 1 else [f"{kind}s[{i}]" for i in range(n)]


class ExtensionBuilder:
    def __init__(self, toolchain: Toolchain, cache: ArtifactCache, pch: PchStore, prelude_policy: str = "auto"):
        # "lean": "auto" without the CUDA facade (benchmarks compare the two side by side).
        if prelude_policy not in ("auto", "lean", "full"):
            raise ValueError("prelude_policy must be 'auto', 'lean' or 'full'")
        self.tc = toolchain
        self.cache = cache
        self.pch = pch
        self.policy = prelude_policy

    # ------------------------------------------------------------------------------ entry
    def compile(self, spec: ExtensionSpec, bdir: Path) -> Built:
        """Build `spec` into `bdir` (raises CompileFailed). The .so and a newly compiled binding
        object stay in `bdir`; the caller checks and publishes them."""
        key = spec.key(self.tc.id)
        plan = self._plan(spec, bdir)
        phases: dict[str, float] = {}
        t_compile = time.monotonic()
        self._compile(spec, bdir, plan)
        phases["compile_wall"] = time.monotonic() - t_compile
        for u in plan.units:
            phases[f"{u.label}_compile"] = phases.get(f"{u.label}_compile", 0.0) + u.seconds
        self._raise_first_failure(plan, bdir, phases)
        plan.notes += self._pch_notes(plan.units)

        binding = None
        if plan.bindable is not None and plan.binding_obj is None:
            unit = next(u for u in plan.units if u.label == "binding")
            plan.binding_obj = bdir / unit.obj
            binding = (self._binding_key(spec, plan.bindable, unit.how), unit.obj)
        so_name = f"{SPLIT_MODULE}.so" if plan.bindable is not None else f"{spec.name}.so"
        objs = [str(bdir / u.obj) for u in plan.units if u.label != "binding"]
        if plan.binding_obj is not None:
            objs.append(str(plan.binding_obj))
            if plan.binding_obj.name.startswith("thunk"):
                objs.append(str(self.pch.shell_object()))
        if plan.facade:
            objs.append(str(self.pch.facade_object()))
        phases["link"] = self._link(spec, bdir, objs, so_name, plan, phases)

        vendor = cxx_scan.vendor_libs_in_sources(list(spec.cpp_sources + spec.cuda_sources), spec.extra_ldflags)
        how = "+".join(sorted({u.how for u in plan.units if u.label in ("kernel", "cuda", "main")})) or "binding-only"
        if plan.bindable is None:
            how = f"monolithic({how})"
        wanted = plan.wanted + [
            (u.prelude, u.profile)
            for u in plan.units
            if u.profile is not None and not self.pch.has(u.prelude, u.profile)
        ]
        compiled = next((u.how for u in plan.units if u.label == "binding"), "")
        if compiled:
            plan.notes.append(f"binding: compiled ({compiled})")
        return Built(
            key=key,
            so_path=str(bdir / so_name),
            prelude=how,
            phases=phases,
            vendor_libs=sorted(vendor),
            cached=False,
            notes=plan.notes,
            pch_wanted=wanted,
            binding=binding,
        )

    def _plan(self, spec: ExtensionSpec, bdir: Path) -> Plan:
        """Which translation units to compile (see the module docstring)."""
        plan = Plan(
            cpp_names=self._write_user_files(bdir, "cpp_source", spec.cpp_sources),
            cu_names=self._write_user_files(bdir, "cuda_source", spec.cuda_sources),
        )
        cpp_text = "\n".join(spec.cpp_sources)
        cu_text = "\n".join(spec.cuda_sources)
        if spec.has_functions and not spec.no_implicit_headers and not cxx_scan.uses_pybind(cpp_text + "\n" + cu_text):
            plan.bindable = cxx_scan.bound_declarations(cpp_text, spec.functions)
            if plan.bindable is None:
                plan.notes.append("bound functions' declarations not read from cpp_sources: one-TU build")
        cu_prelude = self._cuda_prelude(cu_text) if spec.cuda_sources else ""
        if cu_prelude == "lean_cuda" and self._facade_serves(plan, cu_text):
            cu_prelude, plan.facade = "facade_cuda", True
        if plan.bindable is not None:
            if plan.bindable.has_code:
                plan.units.append(self._kernel_unit(spec, bdir, plan.cpp_names, self._cpp_prelude(cpp_text)))
            self._plan_binding(spec, bdir, plan)
        else:
            plan.units.append(self._main_unit(spec, bdir, plan.cpp_names))
        if spec.cuda_sources:
            plan.units.append(self._cuda_unit(spec, bdir, plan.cu_names, cu_prelude))
        return plan

    def _facade_serves(self, plan: Plan, cu_text: str) -> bool:
        """Whether to try the CUDA facade: the C++ side is the bound declarations alone (nothing
        else sees the candidate's tensors), their types are tensors and scalars, the torch headers
        the .cu includes are ones the facade stands for, and the toolchain's facade library and
        module shell are built."""
        if self.policy != "auto" or not self.tc.cuda_facade or plan.bindable is None or plan.bindable.has_code:
            return False
        if not facade.covers_includes(cu_text, cxx_scan.includes(cu_text)):
            return False
        if any(facade.facade_declaration(d.text) is None for d in plan.bindable.declarations):
            return False
        if not self.pch.facade_object().exists():
            plan.wanted.append((FACADE_LIB, ()))
            return False
        return self.pch.shell_object().exists()

    def _plan_binding(self, spec: ExtensionSpec, bdir: Path, plan: Plan) -> None:
        """A cached binding object if one matches, else a thunk TU (when the toolchain's module
        shell exists), else a generated pybind11 TU (and the shell is wanted)."""
        shell = self.pch.shell_object().exists()
        kinds = ("thunk-facade",) if plan.facade else ("thunk", "pybind11") if shell else ("pybind11",)
        for kind in kinds:
            cached = self.cache.binding_object(self._binding_key(spec, plan.bindable, kind))
            if cached.exists():
                plan.binding_obj = cached
                plan.notes.append(f"binding: cached ({kind})")
                return
        if shell:
            plan.units.append(self._thunk_unit(spec, bdir, plan.bindable, plan.facade))
        else:
            plan.units.append(self._binding_unit(spec, bdir, plan.bindable))
            plan.wanted.append((SHELL, ()))

    def _compile(self, spec: ExtensionSpec, bdir: Path, plan: Plan) -> None:
        """All units at once; then lean units that lacked a name again with the full headers; then
        a thunk binding that did not compile (a type thunks do not carry) as a pybind11 binding;
        and if that does not compile either, one load_inline-style TU instead."""
        self._run_all(plan.units, bdir)
        self._retry_facade_failures(spec, bdir, plan)
        self._retry_lean_failures(spec, bdir, plan)
        thunk = next((u for u in plan.units if u.how == "thunk" and not u.ok and not u.infra), None)
        if thunk is not None:
            plan.notes.append(f"thunk binding did not compile ({_first_line(thunk.output)}): pybind11 binding")
            pybind = self._binding_unit(spec, bdir, plan.bindable)
            self._run_all([pybind], bdir)
            pybind.seconds += thunk.seconds
            plan.units = [pybind if u is thunk else u for u in plan.units]
        if any(u.label == "binding" and not u.ok and not u.infra for u in plan.units):
            plan.notes.append("binding TU did not compile from the declarations alone: one-TU build")
            main = self._main_unit(spec, bdir, plan.cpp_names)
            self._run_all([main], bdir)
            plan.units = [u for u in plan.units if u.label not in ("binding", "kernel")] + [main]
            plan.binding_obj, plan.bindable = None, None

    def _run_all(self, units: list[Unit], bdir: Path) -> None:
        pending = [u for u in units if not u.ok]
        if not pending:
            return
        with ThreadPoolExecutor(max_workers=len(pending)) as ex:
            list(ex.map(lambda u: self._run_unit(u, bdir), pending))

    def _run_unit(self, unit: Unit, bdir: Path) -> None:
        t0 = time.monotonic()
        try:
            if unit.label == "cuda":
                returncode, unit.output = nvcc.run(unit.cmd, bdir, _compiler_env(), self.tc.nvcc_parallel)
            else:
                p = subprocess.run(
                    unit.cmd,
                    check=False,
                    cwd=bdir,
                    capture_output=True,
                    text=True,
                    errors="replace",
                    env=_compiler_env(),
                )
                returncode, unit.output = p.returncode, p.stdout + p.stderr
            unit.ok = returncode == 0
            # The class comes from the process's fate, never from its output text (a candidate writes
            # that: `#error "internal compiler error"`). A compiler killed by a signal is only a suspect:
            # the service confirms with a known-good build (service.py, `_confirm_infra`).
            unit.infra = returncode < 0
        except OSError as e:
            unit.output, unit.ok, unit.infra = f"{unit.cmd[0]}: {e}", False, True
        unit.seconds = time.monotonic() - t0

    def _retry_facade_failures(self, spec: ExtensionSpec, bdir: Path, plan: Plan) -> None:
        """When the facade CUDA unit or its thunk binding did not compile (a name or type the
        facade lacks), compile the CUDA unit against the lean CUDA prelude and bind it the usual
        way. Errors are then reported from the lean (or full) compile, as without the facade."""
        cuda = next((u for u in plan.units if u.prelude == "facade_cuda"), None)
        if cuda is None:
            return
        thunk = next((u for u in plan.units if u.how == "thunk-facade"), None)
        failed = [u for u in (cuda, thunk) if u is not None and not u.ok]
        if not failed or any(u.infra for u in failed):
            return
        plan.notes.append(
            f"{failed[0].label}: the CUDA facade lacked something ({_first_line(failed[0].output)}); "
            f"recompiled with the lean CUDA prelude"
        )
        plan.facade, plan.binding_obj = False, None
        plan.units = [u for u in plan.units if u is not cuda and u is not thunk]
        plan.notes = [n for n in plan.notes if n != "binding: cached (thunk-facade)"]
        self._plan_binding(spec, bdir, plan)
        lean = self._cuda_unit(spec, bdir, plan.cu_names, "lean_cuda")
        lean.how = "facade_cuda->lean_cuda"
        plan.units.append(lean)
        self._run_all(plan.units, bdir)
        lean.seconds += cuda.seconds

    def _retry_lean_failures(self, spec: ExtensionSpec, bdir: Path, plan: Plan) -> None:
        """Recompile lean units whose first error is a missing name against the full headers."""
        retry = []
        for u in plan.units:
            if u.ok or u.infra or u.label not in ("kernel", "cuda") or u.prelude not in ("lean", "lean_cuda"):
                continue
            if diagnostics.looks_like_missing_api(u.output):
                full = (
                    self._kernel_unit(spec, bdir, plan.cpp_names, "full")
                    if u.label == "kernel"
                    else self._cuda_unit(spec, bdir, plan.cu_names, "full_cuda")
                )
                full.how = f"{u.how}->{full.prelude}"
                retry.append((u, full))
        if not retry:
            return
        self._run_all([full for _, full in retry], bdir)
        swap = {id(lean): full for lean, full in retry}
        for lean, full in retry:
            plan.notes.append(
                f"{lean.label}: lean prelude lacked a name ({_first_line(lean.output)}); "
                f"recompiled with the full torch headers"
            )
            full.seconds += lean.seconds
        plan.units = [swap.get(id(u), u) for u in plan.units]

    def _raise_first_failure(self, plan: Plan, bdir: Path, phases: dict) -> None:
        for u in plan.units:
            if u.ok:
                continue
            user_files = tuple(plan.cpp_names + plan.cu_names + ["kiln_binding.cpp"])
            message = diagnostics.first_errors(u.output, self._path_names(bdir), user_files)
            raise CompileFailed(message, infra=u.infra, phases=phases, unit=u.label)

    def _link(self, spec, bdir, objs, so_name, plan: Plan, phases) -> float:
        t0 = time.monotonic()
        cmd = [
            self.tc.cxx,
            *self.tc.link_flags,
            *objs,
            "-shared",
            *_split_flags(spec.extra_ldflags),
            *self.tc.link_libs(spec.with_cuda),
            "-o",
            so_name,
        ]
        try:
            p = subprocess.run(
                cmd, check=False, cwd=bdir, capture_output=True, text=True, errors="replace", env=_compiler_env()
            )
        except OSError as e:
            raise CompileFailed(f"linker: {e}", infra=True, phases=phases, unit="link") from e
        if p.returncode != 0:
            out = p.stdout + p.stderr
            message = diagnostics.first_errors(out, self._path_names(bdir), tuple(plan.cpp_names + plan.cu_names))
            raise CompileFailed(message, infra=p.returncode < 0, phases=phases, unit="link")
        return time.monotonic() - t0

    # ------------------------------------------------------------------------------ units
    def _cpp_prelude(self, cpp_text: str) -> str:
        return "full" if self.policy == "full" or cxx_scan.needs_full_torch(cpp_text) else "lean"

    def _cuda_prelude(self, cu_text: str) -> str:
        return "full_cuda" if self.policy == "full" or cxx_scan.needs_full_torch(cu_text) else "lean_cuda"

    def _write_user_files(self, bdir: Path, kind: str, sources: tuple[str, ...]) -> list[str]:
        # Written under the names used in #line, so compilers quote the candidate's code lines.
        names = _user_file_names(kind, len(sources))
        for name, text in zip(names, sources, strict=True):
            (bdir / name).write_text(text)
        return names

    def _tu_text(self, prelude: str | None, names: list[str], sources: tuple[str, ...], tail: str = "") -> str:
        parts = [f'#include "{self.pch.header(prelude)}"'] if prelude else []
        for name, text in zip(names, sources, strict=True):
            parts.append(f'#line 1 "{name}"')
            if prelude == "facade_cuda":
                text = facade.without_covered_includes(text)
            elif prelude in ("lean", "lean_cuda"):
                text = cxx_scan.without_umbrella_includes(text)
            parts.append(text)
        if tail:
            parts.append('#line 1 "kiln_binding.cpp"')
            parts.append(tail)
        return "\n".join(parts) + "\n"

    def _gxx_cmd(self, spec: ExtensionSpec, module: str, user_flags: list[str], src: str, obj: str) -> list[str]:
        # -Winvalid-pch: gcc otherwise skips a precompiled header it cannot use without a word, and
        # the unit silently costs a full parse (see `_pch_notes`).
        pch = ["-Winvalid-pch", "-Wno-error=invalid-pch"] if self.tc.cxx_is_gcc else []
        return [
            self.tc.cxx,
            *self.tc.cxx_flags(),
            *self.tc.common_flags(module, spec.extra_include_paths),
            *user_flags,
            *pch,
            "-c",
            src,
            "-o",
            obj,
        ]

    def _kernel_unit(self, spec, bdir, cpp_names, prelude) -> Unit:
        src, obj = f"kernel_{prelude}.cpp", f"kernel_{prelude}.o"
        (bdir / src).write_text(self._tu_text(prelude, cpp_names, spec.cpp_sources))
        flags = _split_flags(spec.extra_cflags)
        return Unit(
            "kernel",
            prelude,
            src,
            obj,
            self._gxx_cmd(spec, spec.name, flags, src, obj),
            profile=flag_profile(flags) if self.tc.cxx_is_gcc else None,
        )

    def _main_unit(self, spec, bdir, cpp_names) -> Unit:
        """load_inline's main.cpp: implicit header, the candidate's C++, the generated module."""
        prelude = None if spec.no_implicit_headers else "full"
        tail = ""
        if spec.has_functions:
            tail = _module_def(
                "TORCH_EXTENSION_NAME", spec.functions, spec.docstrings, spec.with_pytorch_error_handling
            )
        (bdir / "main.cpp").write_text(self._tu_text(prelude, cpp_names, spec.cpp_sources, tail))
        flags = _split_flags(spec.extra_cflags)
        profile = flag_profile(flags) if prelude and self.tc.cxx_is_gcc else None
        return Unit(
            "main",
            prelude or "none",
            "main.cpp",
            "main.o",
            self._gxx_cmd(spec, spec.name, flags, "main.cpp", "main.o"),
            profile=profile,
        )

    def _thunk_unit(self, spec, bdir, bindable: cxx_scan.Bindable, with_facade: bool = False) -> Unit:
        """The thunk binding; `with_facade`: for a facade-built CUDA unit, with the declarations in
        the facade's types and no torch header in the TU (kiln_facade_thunk.h, thunks.py)."""
        decls = [facade.facade_declaration(d.text) if with_facade else d.text for d in bindable.declarations]
        body = thunks.thunk_source(
            bindable.preamble,
            decls,
            spec.functions,
            spec.docstrings,
            spec.with_pytorch_error_handling,
            facade=with_facade,
        )
        flags = [*BINDING_OPT, *_binding_defines(spec)]
        if with_facade:
            (bdir / "thunk_facade.cpp").write_text(
                f'#include "{self.pch.header("kiln_facade_thunk")}"\n#line 1 "kiln_binding.cpp"\n{body}\n'
            )
            cmd = [
                self.tc.cxx,
                *self.tc.cxx_flags(),
                *self._without_torch(self.tc.common_flags(SPLIT_MODULE, spec.extra_include_paths)),
                *flags,
                "-c",
                "thunk_facade.cpp",
                "-o",
                "thunk_facade.o",
            ]
            return Unit(
                "binding", "facade", "thunk_facade.cpp", "thunk_facade.o", cmd, profile=None, how="thunk-facade"
            )
        (bdir / "thunk.cpp").write_text(
            f'#include "{self.pch.header("lean")}"\n'
            f'#include "{self.pch.header("kiln_thunk")}"\n'
            f'#line 1 "kiln_binding.cpp"\n{body}\n'
        )
        return Unit(
            "binding",
            "lean",
            "thunk.cpp",
            "thunk.o",
            self._gxx_cmd(spec, SPLIT_MODULE, flags, "thunk.cpp", "thunk.o"),
            profile=flag_profile(flags) if self.tc.cxx_is_gcc else None,
            how="thunk",
        )

    def _without_torch(self, flags: list[str]) -> list[str]:
        """Compiler flags with torch's and Python's include directories removed: a facade unit
        reaches no torch header, so nothing slips past the facade and nothing heavy is parsed."""
        hidden = {*self.tc.torch_includes, self.tc.python_include}
        return [
            f
            for i, f in enumerate(flags)
            if f not in hidden and not (f == "-isystem" and i + 1 < len(flags) and flags[i + 1] in hidden)
        ]

    def _binding_unit(self, spec, bdir, bindable: cxx_scan.Bindable) -> Unit:
        body = "\n".join(
            [
                *bindable.preamble,
                *(d.text for d in bindable.declarations),
                _module_def(SPLIT_MODULE, spec.functions, spec.docstrings, spec.with_pytorch_error_handling),
            ]
        )
        (bdir / "binding.cpp").write_text(
            f'#include "{self.pch.header("binding")}"\n#line 1 "kiln_binding.cpp"\n{body}\n'
        )
        flags = [*BINDING_OPT, *_binding_defines(spec)]
        return Unit(
            "binding",
            "binding",
            "binding.cpp",
            "binding.o",
            self._gxx_cmd(spec, SPLIT_MODULE, flags, "binding.cpp", "binding.o"),
            profile=flag_profile(flags) if self.tc.cxx_is_gcc else None,
            how="pybind11",
        )

    def _cuda_unit(self, spec, bdir, cu_names, prelude) -> Unit:
        src, obj = f"cuda_{prelude}.cu", f"cuda_{prelude}.o"
        (bdir / src).write_text(self._tu_text(prelude, cu_names, spec.cuda_sources))
        common = self.tc.common_flags(spec.name, spec.extra_include_paths)
        if prelude == "facade_cuda":
            common = self._without_torch(common)
        cmd = [
            self.tc.nvcc or "nvcc",
            *common,
            *self.tc.nvcc_flags(tuple(_split_flags(spec.extra_cuda_cflags))),
            "-c",
            src,
            "-o",
            obj,
        ]
        return Unit("cuda", prelude, src, obj, cmd, profile=None)

    def _binding_key(self, spec: ExtensionSpec, bindable: cxx_scan.Bindable, kind: str) -> str:
        """Names a binding object: depends on the signatures only, never on kernel code."""
        blob = json.dumps(
            [
                self.tc.id,
                kind,
                bindable.preamble,
                [d.text for d in bindable.declarations],
                spec.functions,
                spec.docstrings,
                spec.with_pytorch_error_handling,
                _binding_defines(spec),
            ]
        )
        return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:32]}"

    def _pch_notes(self, units: list[Unit]) -> list[str]:
        """One note per unit whose precompiled prelude variant exists but gcc refused it, with
        gcc's reason: a slow compile that parsed the whole prelude says why."""
        notes = []
        for u in units:
            if u.profile is None or not self.pch.has(u.prelude, u.profile):
                continue
            variant = self.pch.variant(u.prelude, u.profile).name
            reasons = {
                line.split("not used because", 1)[1].replace("[-Winvalid-pch]", "").strip().rstrip(".")
                for line in u.output.splitlines()
                if variant in line and "not used because" in line
            }
            if reasons:
                notes.append(
                    f"{u.label}: the precompiled {u.prelude} prelude was not used ({'; '.join(sorted(reasons))})"
                )
        return notes

    def _path_names(self, bdir: Path) -> dict[str, str]:
        names = {
            f"{bdir}/": "",
            str(bdir): ".",
            f"{self.pch.root}/": "<kiln-prelude>/",
            f"{self.cache.root}/": "<cache>/",
            self.tc.python_include: "<python>",
        }
        for inc in self.tc.torch_includes:
            names[inc] = "<torch>"
        if self.tc.cuda_home:
            names[self.tc.cuda_home] = "<cuda>"
        return names


def _binding_defines(spec: ExtensionSpec) -> list[str]:
    # Macros can change type layouts (e.g. -D_GLIBCXX_DEBUG): the binding must see the same ones.
    return [f for f in _split_flags(spec.extra_cflags) if f.startswith(("-D", "-U"))]


def _module_def(module: str, functions, docstrings, error_handling: bool) -> str:
    lines = [f"PYBIND11_MODULE({module}, m) {{"]
    # Not strict: a spec read back from the sandbox is not checked for alignment; bind what pairs, as ever.
    for name, doc in zip(functions, docstrings or functions, strict=False):
        fn = f"torch::wrap_pybind_function({name})" if error_handling else name
        lines.append(f"  m.def({json.dumps(name)}, {fn}, {json.dumps(doc)});")
    lines.append("}")
    return "\n".join(lines)


def _first_line(output: str) -> str:
    for line in output.splitlines():
        if "error" in line:
            return line.split("error:", 1)[-1].strip()[:120]
    return ""
