"""BuildResult, and how a capture's events and fate become one.

Two kinds of events make a capture: the service's own (what it built, its symbol check), which are
trusted, and the capture process's (spec requests, exceptions, done), which come from a process that
ran untrusted code and are read defensively: malformed events are skipped, fields are type-checked,
and a process that died before "done" is classified from its exit status, the watchdog's verdict
and its stderr tail.
Error classes: "compile" (the candidate's C++/CUDA or load_inline arguments), "timeout",
"runtime" (module-level code raised, crashed, exited, or exceeded a limit), "infra" (the machine).
"""

from __future__ import annotations

import functools
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import cxx_scan
from .capture import CANDIDATE_FILE
from .spec import ExtensionSpec

MAX_EVENTS = 10_000
MAX_ERROR = 4000  # characters of BuildResult.error (it is quoted in the verdict and stored in the caches)
MAX_NOTES = 20
TAIL_BYTES = 1500  # of a capture process's log, read from its end


@dataclass
class BuildResult:
    ok: bool
    specs: list[ExtensionSpec]  # what the candidate asked to build, in call order
    artifacts: dict[str, str]  # spec key -> path of the built .so
    error: str  # "" or the first errors (trimmed, readable, paths scrubbed)
    error_class: str | None  # None, "compile", "timeout", "runtime", "infra"
    seconds: float
    phases: dict[str, float]  # capture, kernel_compile, binding_compile, cuda_compile, link, cache, ...
    cached: bool  # every artifact came from cache
    vendor_libs: list[str]  # e.g. ["cublas"] when linked/used natively
    toolchain: str = ""  # pass to install_prebuilt together with `artifacts`
    preludes: dict[str, str] = field(default_factory=dict)  # spec key -> how it was built (lean, full, ...)
    notes: list[str] = field(default_factory=list)  # diagnostics: fallbacks taken, cache hits, sandbox notes
    torch_calls: list[str] = field(default_factory=list)  # static hint: at::/torch::/c10:: calls in the sources
    tensor_methods: list[str] = field(default_factory=list)  # static hint: Tensor methods called in the sources
    violations: list[dict] = field(default_factory=list)  # legality findings: forbidden imports, capture audit
    capture_exit: dict = field(default_factory=dict)  # the capture process's own exit status
    sandbox: dict = field(default_factory=dict)  # the capture jail's report: active and missing layers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["specs"] = [s.to_dict() for s in self.specs]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> BuildResult:
        d = dict(d)
        d["specs"] = [ExtensionSpec.from_dict(s) for s in d["specs"]]
        return cls(**d)


def infra_result(message: str, toolchain: str, error_class: str = "infra") -> BuildResult:
    return BuildResult(
        ok=False,
        specs=[],
        artifacts={},
        error=message,
        error_class=error_class,
        seconds=0.0,
        phases={},
        cached=False,
        vendor_libs=[],
        toolchain=toolchain,
    )


@functools.lru_cache(maxsize=1)
def _tensor_methods() -> frozenset[str]:
    import torch

    return frozenset(n for n in dir(torch.Tensor) if not n.startswith("_"))


def _tail(path: Path, n: int = TAIL_BYTES) -> str:
    from .watch import read_tail

    return read_tail(path, n)


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) else 0.0


def assemble(
    events: list[dict], outcome: dict, toolchain: str, timeout_s: float, stderr: Path
) -> tuple[BuildResult, list]:
    """(BuildResult, precompiled-header variants the builds missed) for one finished capture.
    `events`: the capture's messages interleaved with the service's own "built"/"compile_error"
    records (the service writes those; a capture process cannot send one)."""
    specs, artifacts, preludes, phases, vendor, notes, wanted, violations = [], {}, {}, {}, set(), [], [], []
    all_cached = True
    events = [e for e in events[:MAX_EVENTS] if isinstance(e, dict) and isinstance(e.get("event"), str)]
    for e in events:
        kind = e["event"]
        if kind == "spec":
            try:
                specs.append(ExtensionSpec.from_dict(e.get("spec")))
            except (ValueError, TypeError):
                continue
        elif kind == "rejected" and e.get("trusted"):  # a library with findings: there is no artifact
            preludes[e["key"]] = str(e.get("prelude", ""))
            notes += [f"{e['key'][:12]}: {n}" for n in e.get("notes") or [] if isinstance(n, str)]
            all_cached &= e.get("cached") is True
            vendor.update(v for v in e.get("vendor_libs") or [] if isinstance(v, str))
            violations += list(e.get("violations") or [])
        elif kind == "built" and e.get("trusted"):
            artifacts[e["key"]] = e["so"]
            preludes[e["key"]] = str(e.get("prelude", ""))
            all_cached &= e.get("cached") is True
            for k, v in (e.get("phases") or {}).items():
                phases[k] = phases.get(k, 0.0) + _num(v)
            vendor.update(v for v in e.get("vendor_libs") or [] if isinstance(v, str))
            notes += [f"{e['key'][:12]}: {n}" for n in e.get("notes") or [] if isinstance(n, str)]
            wanted += [w for w in e.get("pch_wanted") or [] if isinstance(w, list) and len(w) == 2]
            violations += list(e.get("violations") or [])
        elif kind == "done":
            pass
    violations += list(outcome.get("evidence") or [])  # read by the service from the capture's evidence pipe
    done = next((e for e in events if e["event"] == "done"), None)
    if done:
        phases["capture"] = max(_num(done.get("seconds")) - _num(done.get("compile_seconds")), 0.0)
    sources = [s for spec in specs for s in spec.cpp_sources + spec.cuda_sources]
    calls, methods = cxx_scan.torch_calls(sources, _tensor_methods())
    if done and not specs:
        notes.append("no load_inline call at module level")
    result = BuildResult(
        ok=False,
        specs=specs,
        artifacts=artifacts,
        error="",
        error_class=None,
        seconds=0.0,
        phases=phases,
        cached=bool(artifacts) and all_cached,
        vendor_libs=sorted(vendor)[:20],
        toolchain=toolchain,
        preludes=preludes,
        notes=[n[:500] for n in notes[:MAX_NOTES]],
        torch_calls=calls,
        tensor_methods=methods,
        violations=violations[:50],
    )
    result.error_class, result.error = _classify(events, done, outcome, stderr, timeout_s)
    result.error = result.error[:MAX_ERROR]
    result.ok = result.error_class is None
    return result, wanted


def _classify(
    events: list[dict], done: dict | None, outcome: dict, stderr_path: Path, timeout_s: float
) -> tuple[str | None, str]:
    if outcome.get("infra"):
        return "infra", str(outcome["infra"])
    flood = next((e for e in events if e["event"] == "flood" and e.get("trusted")), None)
    if flood:
        return "runtime", str(flood.get("message", ""))
    failed = next((e for e in events if e["event"] == "compile_error" and e.get("trusted")), None)
    if failed:
        cls = "infra" if failed.get("infra") is True else "compile"
        head = f"load_inline(name={failed.get('name')!r}) failed to build"
        unit = failed.get("unit")
        if unit in ("link", "import"):
            head += f" ({unit} step)"
        return cls, f"{head}:\n{failed.get('message', '')}"
    import_failed = next((e for e in events if e["event"] == "import_error"), None)
    if import_failed:
        return "compile", _import_error_text(str(import_failed.get("name")), str(import_failed.get("message", "")))
    unsupported = next((e for e in events if e["event"] == "unsupported"), None)
    if unsupported:
        return "compile", str(unsupported.get("message", "unsupported load_inline call"))[:MAX_ERROR]
    killed = outcome.get("killed")
    limits = outcome.get("limits", {})
    if killed == "timeout":
        last = events[-1]["event"] if events else "start"
        doing = "compiling an extension" if last in ("spec", "build") else "running module-level code"
        return "timeout", f"the candidate did not finish importing within {timeout_s:.0f} s (still {doing})"
    if killed == "memory":
        return "runtime", (
            f"module-level code exceeded the compile stage's memory limit "
            f"({limits.get('memory_bytes', 0) >> 20} MiB) and was killed"
        )
    if killed == "processes":
        return "runtime", f"module-level code started more than {limits.get('processes')} processes and was killed"
    exc = next((e for e in events if e["event"] == "exception"), None)
    if exc:
        text = f"module-level code raised {exc.get('type')}: {exc.get('message', '')}"
        tb = str(exc.get("traceback") or "")
        return "runtime", (text + ("\n" + tb if tb else ""))[:2400]
    if done:
        return None, ""
    status = outcome.get("status") or {}  # {"exit": n} or {"signal": n}
    stderr = _tail(stderr_path)
    if "signal" in status:
        try:
            name = signal.Signals(int(status["signal"])).name
        except (ValueError, TypeError):
            name = f"signal {status['signal']}"
        return "runtime", f"module-level code crashed the process ({name}){_crash_frames(stderr)}"
    code = status.get("exit")
    return "runtime", (
        f"module-level code ended the process (exit status {code}, e.g. os._exit) before the module finished importing"
    )


def _import_error_text(name: str, message: str) -> str:
    head = f"load_inline(name={name!r}) built a module that does not import"
    if "undefined symbol" in message:
        sym = message.rsplit("undefined symbol:", 1)[-1].strip()[:200]
        return (
            f"{head}: undefined symbol {sym}. A function is declared (or bound) but never defined with "
            f"exactly that signature."
        )
    return f"{head}: {message.rsplit('/', 1)[-1][:300]}" if message else head


def _crash_frames(stderr: str) -> str:
    """The candidate's lines from faulthandler's dump, if any."""
    lines = [ln.strip() for ln in stderr.splitlines() if CANDIDATE_FILE in ln]
    return (":\n" + "\n".join(lines[:5])) if lines else ""
