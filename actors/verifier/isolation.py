"""What each kind of sandboxed process may see (its `JailSpec`), and the watchdog that bounds its memory.

Three kinds of process run outside the verifier's trust boundary (see jail.py for the layers):
* run      imports the candidate and runs it: sees the standard library without the modules that
           expose raw memory or the interpreter's internals (native.DENIED_IMPORTS), of the installed
           packages only torch and what torch needs (and msgpack, the sandbox's own), its own built
           extensions (one directory holding only the libraries of its own build, at jail.LIBDIR) and
           its scratch (at jail.WORKDIR), all read-only; nothing of Kiln's own tree, caches or run
           directories, nor any other candidate's build. It can write no file at all, and its log
           (stdout and stderr) is bounded by the file-size limit (LOG_LIMIT_MB).
* capture  runs the candidate's module-level code at compile time: the same view.
* build    runs the compilers on the candidate's C++/CUDA: additionally the toolchain, the
           precompiled headers and the binding-object cache, read-only; it may run programs.
* reference  runs a reference a client sent (jailed_reference.py): the Python installation as the
           verifier's own process has it (a reference may import what it could import there), and on
           cuda the driver; nothing of Kiln's tree, caches or run directories, homes or /tmp; it can
           write no file and run no program.
Memory is not limited with RLIMIT_AS, which breaks CUDA contexts (they reserve huge virtual ranges):
`RssWatchdog` polls the resident set of the sandbox's whole process tree from the verifier and kills
it past the limit instead.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path

from actors.verifier import proctree
from actors.verifier.jail import LIBDIR, WORKDIR, JailSpec, python_paths

REPO_ROOT = Path(__file__).resolve().parents[2]
# Top-level packages of Kiln: never importable by candidate code (hidden from the sandbox's
# filesystem and removed from sys.modules in it).
KILN_PACKAGES = ("actors", "protocols", "configs", "launch", "tasks", "tests")
_RUN_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",  # how CUDA_VISIBLE_DEVICES' indices are read: as the verifier reads them
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
)
_BUILD_ENV = (
    "PATH",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "CUDA_PATH",
    "TORCH_CUDA_ARCH_LIST",
    "CUDA_VISIBLE_DEVICES",
    "KILN_NVCC_PLAIN",
    "CC",
    "CXX",
)


# The largest file a process that runs candidate code may write: it writes none but its log (stdout and
# stderr, which the verifier reads only the tail of), so the disk it can fill is this much.
LOG_LIMIT_MB = 64


def kiln_hidden(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Paths no sandbox may see: the Kiln tree (source, tasks and their references, tests, run
    directories), Kiln's caches wherever they are, and whatever the caller adds (its cache dir)."""
    paths = [str(REPO_ROOT), os.path.expanduser("~/.cache/kiln")]
    if os.environ.get("KILN_CACHE_DIR"):
        paths.append(os.environ["KILN_CACHE_DIR"])
    if os.environ.get("KILN_PCH_DIR"):
        paths.append(os.environ["KILN_PCH_DIR"])
    return tuple(p for p in [*paths, *extra] if p)


def _env(
    names: tuple[str, ...], base: dict[str, str], pin: dict[str, str] | None = None
) -> tuple[tuple[str, str], ...]:
    env = dict(base)
    env.update({k: os.environ[k] for k in names if k in os.environ})
    env.update(pin or {})
    return tuple(sorted(env.items()))


def run_jail(
    scratch: str,
    *,
    cuda: bool,
    uid: int,
    hidden: tuple[str, ...] = (),
    visible: tuple[str, ...] = (),
    nproc: int = 256,
    gpu: str = "",
    libs: str = "",
) -> JailSpec:
    """The view of a process that runs candidate code (execution or compile-time capture). On cuda it
    also sees the driver: /dev/nvidia* and the directories of the loader's library path. `gpu` (a
    CUDA_VISIBLE_DEVICES entry of the verifier's environment) pins it to that one GPU: the variable is
    set as the jail is entered, before CUDA initialises there (the zygote never initialises it).
    `libs`: the host directory holding this candidate's own built libraries (and nothing else),
    seen read-only at jail.LIBDIR; the scratch is seen at jail.WORKDIR."""
    packages_hidden, packages_shown = candidate_python()
    hide = kiln_hidden(hidden) + packages_hidden
    if cuda:
        visible = tuple(visible) + library_path()
    return JailSpec(
        scratch=scratch,
        hidden=hide,
        visible=python_paths(hide) + packages_shown + tuple(visible),
        cuda=cuda,
        exec_allowed=False,
        writable=False,
        uid=uid,
        nproc=nproc,
        file_size_mb=LOG_LIMIT_MB,
        workdir=WORKDIR,
        mounts=((libs, LIBDIR),) if libs else (),
        env=_env(
            _RUN_ENV,
            {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
            pin={"CUDA_VISIBLE_DEVICES": gpu} if gpu else {},
        ),
    )


def reference_jail(scratch: str, *, cuda: bool, uid: int, hidden: tuple[str, ...] = (), gpu: str = "") -> JailSpec:
    """The view of a process that runs a reference's own code (kind "reference"): a candidate
    sandbox's layers, but the whole Python installation (no module is refused: the process is never
    sealed, so the jail, not the interpreter, is what confines it). Its scratch is read-only at
    jail.WORKDIR and empty; `gpu` pins it to the lane's GPU as run_jail does."""
    hide = kiln_hidden(hidden)
    return JailSpec(
        scratch=scratch,
        hidden=hide,
        visible=python_paths(hide) + (library_path() if cuda else ()),
        cuda=cuda,
        exec_allowed=False,
        writable=False,
        uid=uid,
        nproc=256,
        file_size_mb=LOG_LIMIT_MB,
        workdir=WORKDIR,
        env=_env(
            _RUN_ENV,
            {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
            pin={"CUDA_VISIBLE_DEVICES": gpu} if gpu else {},
        ),
    )


# Distributions a process that runs candidate code sees: torch, what torch needs to run, and the
# sandbox's own wire format. Everything else installed (numpy, cffi, ...) is not there.
CANDIDATE_DISTRIBUTIONS = ("torch", "msgpack")


@functools.lru_cache(maxsize=1)
def candidate_python() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(hidden, shown) paths for the Python a candidate sees: every site-packages directory hidden,
    the files of CANDIDATE_DISTRIBUTIONS and their requirements shown again, and the standard
    library's modules of native.DENIED_IMPORTS hidden."""
    import importlib.metadata
    import importlib.util
    import re
    import site
    import sysconfig

    from actors.verifier.native import DENIED_IMPORTS

    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    sites = {
        os.path.realpath(p)
        for p in [
            *site.getsitepackages(),
            *site.getsitepackages(list(prefixes)),
            site.getusersitepackages(),
            sysconfig.get_paths()["purelib"],
            sysconfig.get_paths()["platlib"],
        ]
        if p and os.path.isdir(p)
    }
    sites |= {os.path.realpath(p) for p in sys.path if p and os.path.basename(p) in ("site-packages", "dist-packages")}
    shown: set[str] = set()
    seen: set[str] = set()
    todo = list(CANDIDATE_DISTRIBUTIONS)
    while todo:
        try:
            dist = importlib.metadata.distribution(todo.pop())
        except importlib.metadata.PackageNotFoundError:
            continue
        name = (dist.metadata["Name"] or "").lower().replace("-", "_")
        if name in seen:
            continue
        seen.add(name)
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or [] if "extra ==" not in r]
        for f in dist.files or []:
            top = str(f).split("/")[0]
            if top in ("..", "__pycache__") or top.split(".")[0] in DENIED_IMPORTS:
                continue
            path = os.path.realpath(str(dist.locate_file(top)))
            if os.path.exists(path):
                shown.add(path)
    denied = []
    for module in DENIED_IMPORTS:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        for path in [getattr(spec, "origin", None), *(getattr(spec, "submodule_search_locations", None) or [])]:
            if path and os.path.exists(path):
                denied.append(os.path.realpath(path))
    return tuple(sorted(sites)) + tuple(sorted(set(denied))), tuple(sorted(shown))


def build_jail(
    scratch: str,
    *,
    uid: int,
    toolchain_paths: tuple[str, ...],
    hidden: tuple[str, ...] = (),
    visible: tuple[str, ...] = (),
    nproc: int = 512,
) -> JailSpec:
    """The view of the compilers: the toolchain, headers and read-only caches they need."""
    hide = kiln_hidden(hidden)
    return JailSpec(
        scratch=scratch,
        hidden=hide,
        visible=python_paths(hide) + toolchain_paths + tuple(visible) + library_path(),
        cuda=False,
        exec_allowed=True,
        uid=uid,
        nproc=nproc,
        env=_env(_BUILD_ENV, {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C", "LC_ALL": "C"}),
    )


def library_path() -> tuple[str, ...]:
    """Existing directories of LD_LIBRARY_PATH (where a container may keep the CUDA driver's libraries)."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d and os.path.isdir(d)]
    return tuple(os.path.realpath(d) for d in dirs)


def hide_kiln_modules() -> None:
    """In a sandbox, before any candidate code: Kiln's modules leave sys.modules (the verifier's own
    code keeps working through the references it holds) and the Kiln tree leaves sys.path, so no
    `import actors...` in candidate code can reach the gate, the clock or anything else of Kiln's."""
    import types

    for name in list(sys.modules):
        if name.split(".")[0] in KILN_PACKAGES:
            del sys.modules[name]
    # The zygote runs as `python -m actors.verifier.zygote`: its module is __main__.
    sys.modules["__main__"] = types.ModuleType("__main__")
    sys.modules.pop("__mp_main__", None)
    root = str(REPO_ROOT)
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != root]
    sys.path_importer_cache.clear()


class RssWatchdog:
    """Kills a sandbox whose process tree's resident memory exceeds `limit_bytes`; `tripped` tells
    afterwards. Works with CUDA contexts, unlike RLIMIT_AS."""

    def __init__(self, pid: int, limit_bytes: int, kill, interval_s: float = 0.05):
        self.pid, self.limit, self._kill, self.interval = pid, limit_bytes, kill, interval_s
        self.tripped = False
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kiln-rss-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            rss = proctree.tree_rss(proctree.descendants(self.pid, limit=1024))
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.tripped = True
                self._kill()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
