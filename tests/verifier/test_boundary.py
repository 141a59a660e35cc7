"""The boundary between the verifier and the processes that run candidate code, property by property
(docs/verifier.md, "Trust by construction"): every read is bounded by what the verifier expects before
it allocates; a reply the sandbox's own code did not send (no MAC) is refused; the code that sends
replies calls nothing the candidate can replace; refusals reach the verifier however the evidence
pipe is tampered with; and no process the boundary started outlives its verifier."""

from __future__ import annotations

import inspect
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import msgpack
import pytest

from actors.verifier import native, proctree, sealed, wire
from actors.verifier.executor import MAX_REPLY, ChildSession, SandboxForged
from tests.helpers.common import runs_as_sandbox

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ bounded reads


def _peer(payload: bytes):
    a, b = socket.socketpair()
    threading.Thread(target=lambda: (b.sendall(payload), time.sleep(2), b.close()), daemon=True).start()
    return a


@pytest.mark.parametrize("announced", [(1 << 31) + 1, (1 << 32) - 1])
def test_a_huge_announced_message_is_refused_before_anything_is_allocated(announced):
    """Class 9: the length a peer announces is checked against what the reader expects first."""
    sock = _peer(struct.pack("<I", announced) + b"x" * 1024)
    tracemalloc.start()
    with pytest.raises(wire.WireError, match="more than"):
        wire.recv(sock, time.monotonic() + 5, max_bytes=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


def test_memory_follows_the_bytes_that_arrive_not_the_bytes_announced():
    """A peer that announces the most it may send and sends 1 KiB costs about 1 KiB, not the announcement."""
    sock = _peer(struct.pack("<I", 1 << 20) + b"x" * 1024)
    tracemalloc.start()
    with pytest.raises(wire.WireError):
        wire.recv(sock, time.monotonic() + 1, max_bytes=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 256 << 10


class _FakeSession(ChildSession):
    """A ChildSession around a socket the test controls (no sandbox behind it)."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:  # no super().__init__: no process behind it
        self.sock, self.key, self.alive, self.requests = sock, key, True, 0
        self._evidence_fd, self.evidence, self._evidence_buf, self._evidence_seen = -1, [], b"", set()
        self.status, self.killed = None, 0
        self.windows, self.addresses, self.sampler = [], None, None
        self.traces, self.traced, self._staged = False, [], 0

    def kill(self) -> None:
        self.killed += 1

    def _reap(self) -> None:
        self.alive = False


def _serve_once(sock: socket.socket, answer) -> None:
    def run():
        (n,) = struct.unpack("<I", sock.recv(4))
        request = msgpack.unpackb(sock.recv(n))
        sock.sendall(answer(request))

    threading.Thread(target=run, daemon=True).start()


def _framed(body: dict, key: bytes | None) -> bytes:
    import hmac

    payload = msgpack.packb(body)
    mac = hmac.digest(key, payload, "sha256") if key else b"\0" * 32
    return struct.pack("<I", len(payload)) + payload + mac


@pytest.mark.parametrize("forge", ["no MAC", "announces too much", "not msgpack"])
def test_a_reply_the_sandbox_code_did_not_send_is_forged(forge):
    """Class 9 and class 8 (the verdict from the channel): a reply must carry the session key's MAC
    and stay within MAX_REPLY; anything else is a forgery, never an infra verdict."""
    ours, theirs = socket.socketpair()
    key = os.urandom(32)
    session = _FakeSession(ours, key)

    def answer(request):
        if forge == "no MAC":
            return _framed({"ok": False, "internal": True, "nonce": request["nonce"]}, None)
        if forge == "announces too much":
            return struct.pack("<I", MAX_REPLY + 1)
        return struct.pack("<I", 4) + b"\xc1\xc1\xc1\xc1" + b"\0" * 32

    _serve_once(theirs, answer)
    with pytest.raises(SandboxForged):
        session.request("call", {}, 5)
    assert session.killed


def test_a_signed_reply_for_another_request_is_forged():
    ours, theirs = socket.socketpair()
    key = os.urandom(32)
    session = _FakeSession(ours, key)
    _serve_once(theirs, lambda request: _framed({"ok": True, "nonce": "another request"}, key))
    with pytest.raises(SandboxForged, match="did not send"):
        session.request("call", {}, 5)


def test_a_signed_reply_is_accepted():
    ours, theirs = socket.socketpair()
    key = os.urandom(32)
    session = _FakeSession(ours, key)
    _serve_once(theirs, lambda request: _framed({"ok": True, "nonce": request["nonce"], "x": 1}, key))
    assert session.request("call", {}, 5)["x"] == 1


def test_a_signed_reply_carries_the_refusals_logged_since_the_last():
    """Refusals travel in the MAC'd reply as well as through the pipe: each is counted once."""
    ours, theirs = socket.socketpair()
    key = os.urandom(32)
    session = _FakeSession(ours, key)
    logged = b"1\tintrospection\tgc.get_objects\tline 3\n2\ttamper\tthe evidence pipe was closed or replaced\t\n"
    _serve_once(theirs, lambda request: _framed({"ok": True, "nonce": request["nonce"], "evidence": logged}, key))
    session.request("call", {}, 5)
    session._record(logged[: logged.index(b"\n") + 1])  # the same first line, read from the pipe too
    assert [(v.kind, v.what) for v in session.evidence] == [
        ("introspection", "gc.get_objects"),
        ("tamper", "the evidence pipe was closed or replaced"),
    ]


# --------------------------------------------------------------------- the server's bytecode

# What a closure of the sealed request loop (`sealed.server` and the factories it calls) may not do: look a name up anywhere but its own frame
# and closure (a global or builtin the candidate could rebind), or an attribute (a method the
# candidate could replace on a type it reaches), or import.
_LOOKUPS = {
    "LOAD_GLOBAL",
    "LOAD_NAME",
    "LOAD_ATTR",
    "LOAD_METHOD",
    "STORE_ATTR",
    "DELETE_ATTR",
    "STORE_GLOBAL",
    "IMPORT_NAME",
    "IMPORT_FROM",
    "LOAD_SUPER_ATTR",
}


def _nested_code(code):
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            yield const
            yield from _nested_code(const)


def _loop_closures():
    """The code of every function the sealed request loop can run: the nested functions of
    `sealed.server` and of each factory it calls to build them, of sealed.py or of a sealed_*.py
    beside it (found from the names its body loads, so a new factory is covered without being listed
    here)."""
    makers = [sealed.server] + [
        getattr(sealed, name)
        for name in sealed.server.__code__.co_names
        if inspect.isfunction(getattr(sealed, name, None))
        and getattr(sealed, name).__module__.startswith(sealed.__name__)  # sealed, sealed_profile, ...
    ]
    return makers, [code for maker in makers for code in _nested_code(maker.__code__)]


def test_the_server_calls_nothing_the_candidate_can_replace():
    """Property: once candidate code exists, the sandbox's request loop runs only callables bound
    before it did (fields of `sealed.Captured`, bound into each factory's closures). A global,
    builtin or attribute lookup in any of its functions would be a door: the candidate rebinds the
    name, the verifier's code calls the candidate's."""
    import dis

    makers, nested = _loop_closures()
    assert len(makers) >= 10, [m.__name__ for m in makers]
    assert "make_op_profile" in {m.__name__ for m in makers}
    found = [(c.co_name, i.opname, i.argval) for c in nested for i in dis.get_instructions(c) if i.opname in _LOOKUPS]
    assert found == []
    # the factories' own bodies only bind and build (their lookups run before any candidate code); every
    # handler the loop dispatches to, and every helper they call, is one of the closures checked
    assert {c.co_name for c in nested} >= {
        "serve",
        "receive",
        "read",
        "reply",
        "tensor_at",
        "staged",
        "delayed",
        "lay_out",
        "outputs_of",
        "lookalike",
        "failure",
        "patched",
        "any_fatal",
        "op_load",
        "op_build",
        "op_call",
        "op_stage",
        "op_trip",
        "op_fetch",
        "op_profile",
    }


def test_the_bytecode_check_sees_a_lookup():
    """The check above is not vacuous: a nested function with one global lookup is found."""

    def outer():
        def inner():
            return len([])

        return inner

    import dis

    ops = [i.opname for c in _nested_code(outer.__code__) for i in dis.get_instructions(c)]
    assert _LOOKUPS & set(ops)


# ------------------------------------------------------------------------- the evidence log

_EVIDENCE_PROBE = textwrap.dedent(r"""
    import os, sys
    from actors.verifier import native
    kn = native.load(native.NATIVE, sys.argv[1])
    r, w = os.pipe()
    kn.arm(w, "candidate.py", "x = 1\n", native.DENIED_IMPORTS, native.KILN_PACKAGES, native.TRUSTED_ROOT, None)
    def refuse(name):
        try:
            __import__(name)
        except RuntimeError:
            pass
    refuse("ctypes")             # 1: logged and written to the pipe
    piped = os.read(r, 65536)
    if sys.argv[2] == "close":
        os.close(w)
    else:                         # replaced: a pipe of the candidate's own under the same number
        r2, w2 = os.pipe()
        os.dup2(w2, w)
    refuse("numpy")              # the tamper (2) and this refusal (3) are logged; nothing is written
    log, end, count = kn.evidence_since(0)
    tail, end2, _ = kn.evidence_since(end)
    print(repr((piped, log, count, tail, end2 == end)))
""")


@pytest.mark.parametrize("tamper", ["close", "replace"])
def test_refusals_reach_the_log_however_the_pipe_is_tampered_with(tmp_path, tamper):
    """Property: a refusal is never lost to the candidate's descriptors. kiln_native numbers each one
    into a log in static memory (which the signed replies carry); a closed or replaced evidence pipe
    is found by the pipe's identity before the next write and is itself logged."""
    so = tmp_path / native.filename(native.NATIVE)
    subprocess.run(native.native_command(so), check=True, capture_output=True, timeout=120)
    out = subprocess.run(
        [sys.executable, "-c", _EVIDENCE_PROBE, str(so), tamper],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    piped, log, count, tail, same_end = eval(out.stdout)
    assert [r[:3] for r in native.evidence_records(piped)] == [(1, "forbidden_import", "import ctypes")]
    assert [r[:3] for r in native.evidence_records(log)] == [
        (1, "forbidden_import", "import ctypes"),
        (2, "tamper", "the evidence pipe was closed or replaced"),
        (3, "forbidden_import", "import numpy"),
    ]
    assert count == 3 and tail == b"" and same_end


# ------------------------------------------------------------------------------- no orphans


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are given by a root verifier")
def test_no_process_of_the_boundary_outlives_its_verifier(verifier_cache_dir):
    """SIGKILL to a verifier whose sandbox spins in forward: the zygote, the warden and the sandbox
    (which changed uid, which clears a parent-death signal) are all gone within 10 s."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("orphan_probe.py")), str(verifier_cache_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("zygote "), line
        zygote = int(line.split()[1])
        deadline = time.monotonic() + 120
        tree: list[int] = []
        while time.monotonic() < deadline:
            tree = proctree.descendants(zygote)
            if any(runs_as_sandbox(p) for p in tree[1:]) and _spinning(tree):
                break
            time.sleep(0.2)
        assert any(runs_as_sandbox(p) for p in tree[1:]), f"no sandbox started under the zygote: {tree}"
        proc.kill()
        proc.wait(10)
        killed_at = time.monotonic()
        left = tree
        while left and time.monotonic() - killed_at < 10:
            left = [p for p in tree if _alive(p)]
            time.sleep(0.1)
        assert not left, f"still running 10 s after the verifier died: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()


def _spinning(pids: list[int]) -> bool:
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "R" and runs_as_sandbox(p):
                    return True
        except (OSError, IndexError):
            continue
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
