"""Why a precompiled part was not built is always said (actors/verifier/build/preludes.py): a build that
the closing service stopped is `PchAborted`, not a failure (a start-up check's verifier closes while
its headers build, and the run's verifier then builds them), and a compiler that fails without a word
of output is named by its exit status or signal. The "compiler" here is `sh -c SCRIPT`, through the
store's own launcher."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from actors.verifier.build.preludes import SHELL, PchAborted, PchStore


@dataclass
class _ShellToolchain:
    """A toolchain whose compiler runs `script` (the compile arguments become the script's $0, $1...)."""

    script: str
    cxx: str = "sh"
    cxx_is_gcc: bool = True
    digest: str = "test-toolchain"

    def cxx_flags(self) -> list[str]:
        return ["-c", self.script]

    def common_flags(self, extension_name, user_includes=()) -> list[str]:
        return []


def test_a_build_stopped_by_the_closing_service_is_aborted_not_failed(tmp_path):
    store = PchStore(tmp_path, _ShellToolchain("sleep 30"))
    threading.Timer(0.5, store.abort).start()
    started = time.monotonic()
    with pytest.raises(PchAborted, match="stopped: the build service closed"):
        store.build(SHELL, ())
    assert time.monotonic() - started < 10  # killed, not waited for
    assert not store.shell_object().exists()
    with pytest.raises(PchAborted, match="not started"):  # and nothing new starts
        store.build(SHELL, ())


def test_a_silent_compiler_failure_names_its_exit_status(tmp_path):
    with pytest.raises(RuntimeError, match=r"failed \(exit status 3\) without a word of output") as err:
        PchStore(tmp_path, _ShellToolchain("exit 3")).build(SHELL, ())
    assert not isinstance(err.value, PchAborted)
    with pytest.raises(RuntimeError, match=r"failed \(killed by signal 9\)"):
        PchStore(tmp_path / "b", _ShellToolchain("kill -9 $$")).build(SHELL, ())


def test_a_compiler_failure_carries_its_output(tmp_path):
    with pytest.raises(RuntimeError, match=r"failed \(exit status 1\):\nerror: no such header"):
        PchStore(tmp_path, _ShellToolchain("echo 'error: no such header'; exit 1")).build(SHELL, ())
