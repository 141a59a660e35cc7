"""Sandbox robustness: a crash, an endless loop or a memory hog costs one sandbox child, the verdict
says what happened, and the next request is served by a fresh child; the zygote itself is replaced
if it dies. Children have no network."""

from __future__ import annotations

import os
import signal
import socket
import uuid

import pytest

from actors.verifier.suite import load_suite
from actors.verifier.verifier import KernelVerifier
from configs import load_config
from protocols import VerifyRequest

SUITE = {c.name: c for c in load_suite("cpu")}


@pytest.fixture(scope="module")
def verifier(verifier_cache_dir):
    items = {
        "verifier.cache_dir": verifier_cache_dir,
        "verifier.trials": 4,
        "verifier.run_timeout_s": 6,
        "verifier.memory_limit_mb": 1536,
        "verifier.compile_baseline": "never",
        "verifier.repeats": 5,
    }
    v = KernelVerifier(load_config(None, [f"{k}={val}" for k, val in items.items()]).verifier)
    yield v
    v.close()


def fresh_control(verifier, task):
    """The control kernel with a unique comment: a fresh execution (no verdict-cache hit), same build."""
    source = SUITE["control_correct"].source() + f"\n# {uuid.uuid4().hex}\n"
    return verifier.verify(VerifyRequest(request_id=uuid.uuid4().hex, task=task, candidate=source))


@pytest.mark.parametrize(
    "case, error_class, needle",
    [
        ("crash_segfault", "runtime", "segmentation fault"),
        ("infinite_loop", "timeout", "exceeded the 6 s limit"),
        ("out_of_memory", "runtime", "killed by the memory watchdog (out of memory)"),  # 1536 MB + the arena
    ],
)
def test_a_lost_child_is_replaced_and_the_next_request_served(verifier, relu_task, case, error_class, needle):
    children = verifier.lanes.all[0].pool.children
    source = SUITE[case].source() + f"\n# {uuid.uuid4().hex}\n"  # no verdict-cache hit from another module
    bad = verifier.verify(VerifyRequest(request_id=case, task=relu_task, candidate=source))
    assert bad.error_class == error_class and needle in bad.feedback and bad.score == -1.0 and not bad.cached
    good = fresh_control(verifier, relu_task)
    assert good.passed and not good.cached, good.feedback
    assert verifier.lanes.all[0].pool.children == children + 2  # one child per candidate: the lost one was not reused


def test_the_zygote_is_restarted_when_it_dies(verifier, relu_task):
    fresh_control(verifier, relu_task)
    starts, pid = verifier.lanes.all[0].pool.zygote.starts, verifier.lanes.all[0].pool.zygote.pid
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    good = fresh_control(verifier, relu_task)
    assert good.passed, good.feedback
    assert verifier.lanes.all[0].pool.zygote.starts == starts + 1 and verifier.lanes.all[0].pool.zygote.pid != pid


def test_sandbox_children_have_no_network(verifier, relu_task):
    """A candidate that reaches for the network is refused and flagged, and its connection never arrives."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    source = (
        SUITE["control_correct"]
        .source()
        .replace(
            "class ModelNew(nn.Module):",
            f"""socket = __builtins__["__imp" + "ort__"]("soc" + "ket") if isinstance(__builtins__, dict) else getattr(
    __builtins__, "__imp" + "ort__")("soc" + "ket")  # a built name: past the static scan, to the sandbox


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
        except Exception:
            pass
""",
        )
        + f"\n# {uuid.uuid4().hex}\n"
    )
    r = verifier.verify(VerifyRequest(request_id="net", task=relu_task, candidate=source))
    assert r.error_class == "cheating" and any(v["kind"] == "network" for v in r.diagnostics["violations"]), r.feedback
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_verdicts_are_cached_by_source_and_task(verifier, relu_task):
    source = SUITE["control_correct"].source() + f"\n# {uuid.uuid4().hex}\n"
    first = verifier.verify(VerifyRequest(request_id="first", task=relu_task, candidate=source))
    again = verifier.verify(VerifyRequest(request_id="again", task=relu_task, candidate=f"```python\n{source}```"))
    assert first.passed and not first.cached
    assert again.cached and again.request_id == "again" and again.score == first.score
    assert again.source_hash == first.source_hash and set(again.timings) == {"cache"}
