"""Sandbox robustness: a crash, an endless loop or a memory hog costs one sandbox child, the verdict
says what happened, and the next request is served by a fresh child; the zygote itself is replaced
if it dies. Children have no network."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid

import pytest

from actors.verifier.extract import extract
from actors.verifier.suite import load_suite
from actors.verifier.verdicts import verdict_key
from actors.verifier.verifier import KernelVerifier
from configs import load_config
from protocols import VerifyRequest

SUITE = {c.name: c for c in load_suite("cpu")}


# The module's verifier settings; each verifier here adds its cache directory.
ITEMS = {
    "verifier.trials": 4,
    "verifier.run_timeout_s": 6,
    "verifier.memory_limit_mb": 1536,
    "verifier.compile_baseline": "never",
    "verifier.repeats": 5,
}


def make_verifier(cache_dir) -> KernelVerifier:
    items = {**ITEMS, "verifier.cache_dir": cache_dir}
    return KernelVerifier(load_config(None, [f"{k}={val}" for k, val in items.items()]).verifier)


@pytest.fixture(scope="module")
def verifier(verifier_cache_dir):
    v = make_verifier(verifier_cache_dir)
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


def test_a_verifier_closed_mid_run_answers_infra_caches_nothing_and_starts_no_zygote(verifier_cache_dir, relu_task):
    # A service's verifiers share one verdict cache. One stopped mid-run kills its sandboxes with its
    # zygote; that run's crash says nothing about the candidate, yet it used to be answered `runtime`
    # (-1) and cached, so the job's retry on another verifier got the cached -1; and the run's reap
    # started a new zygote after close. Mutations: drop `if self.closing` in KernelVerifier._verify ->
    # runtime and a cache entry; drop `_closed` in Zygote._ensure -> zygote.starts == 2.
    v = make_verifier(verifier_cache_dir)
    source = SUITE["infinite_loop"].source() + f"\n# {uuid.uuid4().hex}\n"
    out = {}
    call = threading.Thread(
        target=lambda: out.update(r=v.verify(VerifyRequest(request_id="closed", task=relu_task, candidate=source)))
    )
    call.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not v.lanes.all[0].pool.children:  # its sandbox started
        time.sleep(0.05)
    time.sleep(1.0)  # in forward's endless loop (the limit is 6 s)
    v.close()
    call.join(timeout=30)
    r = out["r"]
    assert r.error_class == "infra" and r.score == 0.0 and "stopped" in r.feedback, r.feedback
    key = verdict_key(extract(source).source_hash, relu_task, v.toolchain, v.cfg)
    assert v.verdicts.get(key, extract(source).source_hash, relu_task.task_id) is None
    assert v.zygote.starts == 1 and v.zygote.pid is None


def test_a_cancelled_verification_ends_at_once_answers_infra_and_caches_nothing(verifier, relu_task):
    # A service whose deadline passed cancels the work (KernelVerifier.cancel): the sandbox is killed
    # at once, the call answers infra and nothing is cached. Mutation: make CandidateRun.cancel not
    # kill its child -> the call runs into its 6 s limit (timeout) and is cached.
    source = SUITE["infinite_loop"].source() + f"\n# {uuid.uuid4().hex}\n"
    children = verifier.lanes.all[0].pool.children
    out = {}
    request = VerifyRequest(request_id=uuid.uuid4().hex, task=relu_task, candidate=source)
    call = threading.Thread(target=lambda: out.update(r=verifier.verify(request)))
    call.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and verifier.lanes.all[0].pool.children == children:
        time.sleep(0.05)
    time.sleep(0.5)
    asked = time.monotonic()
    assert verifier.cancel(request.request_id)
    call.join(timeout=30)
    assert time.monotonic() - asked < 3.0  # the run's limit is 6 s
    r = out["r"]
    assert r.error_class == "infra" and "cancelled" in r.feedback, r.feedback
    assert not verifier.cancel(request.request_id)  # no longer in flight
    key = verdict_key(extract(source).source_hash, relu_task, verifier.toolchain, verifier.cfg)
    assert verifier.verdicts.get(key, extract(source).source_hash, relu_task.task_id) is None
    assert fresh_control(verifier, relu_task).passed
