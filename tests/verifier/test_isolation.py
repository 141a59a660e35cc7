"""Candidates isolated from each other and from the host (docs/verifier.md, P15).

A process that runs candidate code (the compile stage's capture, the execution sandbox) sees the
libraries of its own build only, at a neutral path, its scratch at a neutral path, and a hostname of
its own; a library that failed the symbol check is never kept where anything could load it; native
extensions load only from the candidate's own build, whoever asks; and no verdict carries a host
path, the host's name or another candidate's name. One verifier serves the module, on the
session's cache. Each test names the mutation that reopens the hole it guards.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from actors.verifier import jail
from actors.verifier.verifier import KernelVerifier
from tests.verifier.integrity import SUITE, config, verify

REPO = Path(__file__).resolve().parents[2]
NONCE = uuid.uuid4().hex[:8]

# A correct relu kernel that also imports mprotect: the symbol check rejects its library.
REJECTED = f"""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r'''// isolation {NONCE}
#include <sys/mman.h>
int kiln_protect(void* p) {{ return mprotect(p, 4096, 7); }}
torch::Tensor relu_a(torch::Tensor x) {{
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) d[i] = s[i] > 0.0f ? s[i] : 0.0f;
    return y;
}}
'''
ext = load_inline(name="kiln_iso_rejected", cpp_sources=source, functions=["relu_a"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu_a(x)
"""

# Another candidate that loads that library through importlib's ExtensionFileLoader (_imp.create_dynamic
# below it), from where the cache would keep it, and calls its kernel.
THIEF = """
import torch
import torch.nn as nn

load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
machinery = load("importlib.machinery", fromlist=["ExtensionFileLoader"])
util = load("importlib.util", fromlist=["module_from_spec"])
STOLEN = %r
FOUND = []


def stolen():
    if not FOUND:
        name = "kiln_stolen." + STOLEN.rsplit("/", 1)[-1][:-3]
        loader = machinery.ExtensionFileLoader(name, STOLEN)
        spec = util.spec_from_file_location(name, STOLEN, loader=loader)
        module = util.module_from_spec(spec)
        spec.loader.exec_module(module)
        FOUND.append(module)
    return FOUND[0]


class ModelNew(nn.Module):
    def forward(self, x):
        return stolen().relu_a(x)
"""

PROBE = """
load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
os = load("o" + "s")
json = load("json")


def observe():
    own = os.path.dirname(os.path.realpath(adv.__file__))
    with open("/proc/sys/kernel/hostname") as f:
        proc_host = f.read().strip()
    return {"file": os.path.realpath(adv.__file__), "builds": sorted(os.listdir(os.path.dirname(own))),
            "own": os.path.basename(own), "cwd": os.getcwd(), "node": os.uname().nodename,
            "proc_host": proc_host, "home": os.environ.get("HOME")}


if %r == "capture" and "candidate.py" in os.listdir(os.getcwd()):
    raise ValueError("PROBE" + json.dumps(observe()) + "PROBE")


class ModelNew(nn.Module):
    def forward(self, x):
        raise ValueError("PROBE" + json.dumps(observe()) + "PROBE")
"""


@pytest.fixture(scope="module")
def verifier(verifier_cache_dir):
    v = KernelVerifier(config(verifier_cache_dir))
    yield v
    v.close()


@pytest.fixture(scope="module")
def rejected(verifier, relu_task):
    """(its verdict, its spec key, where a cache that kept it would keep it) of the rejected build."""
    r = verify(verifier, relu_task, REJECTED)
    build = verifier.builds.submit(REJECTED).result()
    key = build.specs[0].key(build.toolchain)
    path = build.artifacts.get(key) or str(verifier.builds.cache.root / "ext" / key / "kiln_ext.so")
    return r, key, path


def test_a_library_that_failed_the_symbol_check_is_never_published(verifier, rejected):
    """Its findings are remembered (a second build of it is the same verdict, from the cache), the
    library is not: nothing under the cache's ext/ holds it. Reopened by: publishing before the check
    in build/service.BuildService.build (as the code before did, for every library)."""
    r, key, _ = rejected
    assert r.error_class == "cheating" and "mprotect" in r.feedback, r.feedback
    root = verifier.builds.cache.root
    assert not (root / "ext" / key).exists()
    assert (root / "rejected" / f"{key}.json").is_file()
    again = verifier.builds.submit(REJECTED + "\n# again\n").result()
    assert again.violations and not again.artifacts


def test_another_candidates_rejected_library_cannot_be_loaded_through_imp(verifier, relu_task, rejected):
    """The red team's case: a candidate loads another's library (rejected by the symbol check, left
    in the shared cache) through importlib's loader (`_imp.create_dynamic`) and calls its kernel. It is not there, not in
    the sandbox's view, and the load itself is refused whoever asks (kiln_native's extension rule).
    Reopened by: removing check_extension from kiln_native's audit hook together with publishing the
    rejected library (on the code before, this candidate passed with a speed score)."""
    _, _, path = rejected
    r = verify(verifier, relu_task, THIEF % path)
    assert not r.passed and r.score == -1.0, r.feedback
    assert r.error_class == "cheating" and "load " in r.feedback, r.feedback


@pytest.mark.parametrize("where", ["capture", "run"])
def test_a_sandbox_sees_only_its_own_build_at_neutral_paths_and_not_the_hosts_name(
    verifier, relu_task, rejected, where
):
    """The compile stage's capture process and the execution sandbox each see the libraries of their
    own build only (one directory, at jail.LIBDIR), their scratch at jail.WORKDIR, and the hostname
    "sandbox" (their own UTS namespace). Reopened by: the jail's `visible` holding the cache's ext/
    (verifier.py and build/service.py before), `_set_hostname` removed from jail.enter, or
    `workdir=WORKDIR` removed from isolation.run_jail."""
    source = SUITE["control_correct"].source() + PROBE % where + f"\n# {uuid.uuid4().hex}\n"
    r = verify(verifier, relu_task, source)
    message = r.diagnostics.get("error", "")
    assert "PROBE" in message, (r.error_class, r.feedback)
    seen = json.loads(message.split("PROBE")[1])
    assert seen["file"].startswith(jail.LIBDIR + "/") and seen["builds"] == [seen["own"]], seen
    assert seen["cwd"] == jail.WORKDIR and seen["home"] == jail.WORKDIR, seen
    assert seen["node"] == seen["proc_host"] == jail.HOSTNAME != socket.gethostname(), seen


def test_extensions_load_only_from_the_candidates_own_build(verifier, relu_task):
    """A library that is not of the candidate's own build (torch's own, here) loaded through
    `_imp.create_dynamic` is refused and recorded, whoever calls it; standard extension modules
    imported lazily still load (honest_lazy_imports passes in the suite). Reopened by: removing
    check_extension from kiln_native's audit hook."""
    r = verify(verifier, relu_task, SUITE["imp_foreign_library"].source() + f"\n# {uuid.uuid4().hex}\n")
    assert r.error_class == "cheating" and "libtorch_global_deps" in r.feedback, r.feedback


def _host_details() -> list[str]:
    """What would say where and on which host the verifier runs."""
    details = [str(REPO), os.path.expanduser("~") + "/", tempfile.gettempdir() + "/", socket.gethostname()]
    return [d for d in details if len(d) >= 4 and d != jail.HOSTNAME]


CRASH_TAIL = """
import torch
import torch.nn as nn

load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
os = load("o" + "s")
sys_ = load("s" + "ys")


class ModelNew(nn.Module):
    def forward(self, x):
        print("torch at", torch.__file__, "python at", sys_.prefix, sys_.path, flush=True)
        getattr(os, "ab" + "ort")()
"""
EXCEPTION = """
import torch
import torch.nn as nn

load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
sys_ = load("s" + "ys")
os = load("o" + "s")


class ModelNew(nn.Module):
    def forward(self, x):
        raise ValueError(f"torch at {torch.__file__}; python at {sys_.prefix}; {sys_.path}; host {os.uname().nodename}")
"""


@pytest.mark.parametrize("case", ["exception", "crash_tail"])
def test_feedback_names_no_host_path_or_host_name(verifier, relu_task, case):
    """Exception text and the "last output" tail of a crashed sandbox quote the paths of the Python
    installation and torch (the host's: here inside Kiln's tree) and the host's name: the verdict
    names them neutrally (<torch>, <python>, <kiln>, ~, <tmp>, <host>). Reopened by: removing the
    redaction in verifier.KernelVerifier._result (redact.feedback / redact.diagnostics)."""
    source = {"exception": EXCEPTION, "crash_tail": CRASH_TAIL}[case] + f"\n# {uuid.uuid4().hex}\n"
    r = verify(verifier, relu_task, textwrap.dedent(source))
    assert r.error_class == "runtime", r.feedback
    assert "<torch>" in r.feedback or "<python>" in r.feedback, r.feedback
    text = r.feedback + json.dumps(r.diagnostics)
    leaked = [d for d in _host_details() if d in text]
    assert leaked == [], (leaked, r.feedback)
