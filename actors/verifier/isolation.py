"""What each kind of sandboxed process may see (its `JailSpec`), and the watchdog that bounds its memory.

Three kinds of process run outside the verifier's trust boundary (see jail.py for the layers):
* run      imports the candidate and runs it: sees the Python installation, the built extensions
           (read-only), its scratch; nothing of Kiln's own tree, caches or run directories.
* capture  runs the candidate's module-level code at compile time: the same view.
* build    runs the compilers on the candidate's C++/CUDA: additionally the toolchain, the
           precompiled headers and the binding-object cache, read-only; it may run programs.
Memory is not limited with RLIMIT_AS, which breaks CUDA contexts (they reserve huge virtual ranges):
`RssWatchdog` polls the resident set of the sandbox's whole process tree from the verifier and kills
it past the limit instead.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from actors.verifier import proctree
from actors.verifier.jail import JailSpec, python_paths

REPO_ROOT = Path(__file__).resolve().parents[2]
# Top-level packages of Kiln: never importable by candidate code (hidden from the sandbox's
# filesystem and removed from sys.modules in it).
KILN_PACKAGES = ("actors", "protocols", "configs", "launch", "tasks", "tests")
_RUN_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTORCH_NVML_BASED_CUDA_CHECK",
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
_BUILD_ENV = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST", "CUDA_VISIBLE_DEVICES",
              "KILN_NVCC_PLAIN", "CC", "CXX")


def kiln_hidden(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Paths no sandbox may see: the Kiln tree (source, tasks and their references, tests, run
    directories), Kiln's caches wherever they are, and whatever the caller adds (its cache dir)."""
    paths = [str(REPO_ROOT), os.path.expanduser("~/.cache/kiln")]
    if os.environ.get("KILN_CACHE_DIR"):
        paths.append(os.environ["KILN_CACHE_DIR"])
    if os.environ.get("KILN_PCH_DIR"):
        paths.append(os.environ["KILN_PCH_DIR"])
    return tuple(p for p in [*paths, *extra] if p)


def _env(names: tuple[str, ...], base: dict[str, str]) -> tuple[tuple[str, str], ...]:
    env = dict(base)
    env.update({k: os.environ[k] for k in names if k in os.environ})
    return tuple(sorted(env.items()))


def run_jail(scratch: str, *, cuda: bool, uid: int, hidden: tuple[str, ...] = (), visible: tuple[str, ...] = (),
             nproc: int = 256) -> JailSpec:
    """The view of a process that runs candidate code (execution or compile-time capture). On cuda it
    also sees the driver: /dev/nvidia* and the directories of the loader's library path."""
    hide = kiln_hidden(hidden)
    if cuda:
        visible = tuple(visible) + library_path()
    return JailSpec(scratch=scratch, hidden=hide, visible=python_paths(hide) + tuple(visible), cuda=cuda,
                    exec_allowed=False, uid=uid, nproc=nproc,
                    env=_env(_RUN_ENV, {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}))


def build_jail(scratch: str, *, uid: int, toolchain_paths: tuple[str, ...], hidden: tuple[str, ...] = (),
               visible: tuple[str, ...] = (), nproc: int = 512) -> JailSpec:
    """The view of the compilers: the toolchain, headers and read-only caches they need."""
    hide = kiln_hidden(hidden)
    return JailSpec(scratch=scratch, hidden=hide,
                    visible=python_paths(hide) + toolchain_paths + tuple(visible) + library_path(),
                    cuda=False, exec_allowed=True, uid=uid, nproc=nproc,
                    env=_env(_BUILD_ENV, {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C", "LC_ALL": "C"}))


def library_path() -> tuple[str, ...]:
    """Existing directories of LD_LIBRARY_PATH (where a container may keep the CUDA driver's libraries)."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d and os.path.isdir(d)]
    return tuple(os.path.realpath(d) for d in dirs)


def hide_kiln_modules() -> None:
    """In a sandbox, before any candidate code: Kiln's modules leave sys.modules (the verifier's own
    code keeps working through the references it holds) and the Kiln tree leaves sys.path, so no
    `import actors...` in candidate code can reach the gate, the clock or anything else of Kiln's."""
    import sys

    for name in list(sys.modules):
        if name.split(".")[0] in KILN_PACKAGES:
            del sys.modules[name]
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
