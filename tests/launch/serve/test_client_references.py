"""A reference a client sends runs sandboxed (actors/verifier/jailed_reference.py): through `kiln serve`
over real HTTP, with the kernel verifier behind it on the cpu backend. What a hostile reference tries
is confined (each attempt checked on the host's side), its failures are the reference's (infra, score
0, one line), never the candidate's, and the service serves the next request; an honest kernel passes
against a client's reference as it does against the same task of the served set (in process)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from configs import load_config
from launch.serve.cli import start
from protocols.verifier_client import VerifierClient

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "client-token-0123456789"
RELU_TASK = (ROOT / "tasks/level1/01_relu.py").read_text()
RELU_SOLUTION = (ROOT / "tasks/solutions/cpu/level1/01_relu.py").read_text()

# Everything a hostile reference tries, each attempt's outcome kept, then raised as one line: if an
# attempt got through, its proof (the secret's text, "wrote", "connected", ...) comes back to the test.
PROBE = """
import os, signal, socket, subprocess

def _probe():
    seen = []
    try:
        seen.append("secret:" + open({secret!r}).read())
    except OSError as err:
        seen.append("read:" + type(err).__name__)
    try:
        open({written!r}, "w").write("x")
        seen.append("wrote")
    except OSError as err:
        seen.append("write:" + type(err).__name__)
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=1)
        seen.append("connected")
    except OSError as err:
        seen.append("tcp:" + type(err).__name__)
    seen.append("pids:" + ",".join(sorted(p for p in os.listdir("/proc") if p.isdigit())))
    try:
        os.kill({victim}, signal.SIGKILL)
        seen.append("killed")
    except OSError as err:
        seen.append("kill:" + type(err).__name__)
    try:
        subprocess.run(["/bin/sh", "-c", "echo x > {ran}"], check=False)
        seen.append("ran")
    except OSError as err:
        seen.append("run:" + type(err).__name__)
    raise RuntimeError(" ".join(seen))
"""


def small_reference(*, at_import: str = "", in_inputs: str = "", in_forward: str = "") -> str:
    """A ReLU task whose module, get_inputs or forward first runs the given statement."""
    return f"""
import torch

batch_size = 16
dim = 256
KILN_ALT_SHAPES = []


class Model(torch.nn.Module):
    def forward(self, x):
        {in_forward or "pass"}
        return torch.relu(x)


def get_init_inputs():
    return []


def get_inputs():
    {in_inputs or "pass"}
    return [torch.randn(batch_size, dim)]


{at_import}
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory, verifier_cache_dir):
    tmp = tmp_path_factory.mktemp("client-references")
    tokens = tmp / "tokens"
    tokens.write_text(f"client {TOKEN}\n")
    cfg = load_config(
        None,
        [
            "verifier.backend=cpu",
            f"verifier.cache_dir={verifier_cache_dir}",
            "verifier.trials=2",
            "verifier.repeats=1",
            "verifier.warmup=0",
            "verifier.compile_baseline=never",
            "verifier.profile_kernels=0",
            "verifier.reference_timeout_s=3",
            "serve.port=0",
            f"serve.token_file={tokens}",
        ],
    )
    running = start(cfg)
    yield running, tmp, tokens
    running.stop()


@pytest.fixture
def host(service, tmp_path):
    """The host's side of the probe: a secret (the service's own token file), paths to write, a TCP
    listener and a process to signal; what each looks like afterwards is the test's evidence."""
    _, _, tokens = service
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    victim = subprocess.Popen(["sleep", "60"])
    probe = PROBE.format(
        secret=str(tokens),
        written=str(tmp_path / "written"),
        port=listener.getsockname()[1],
        victim=victim.pid,
        ran=str(tmp_path / "ran"),
    )
    yield probe, tmp_path, listener, victim
    victim.kill()
    victim.wait()
    listener.close()


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_an_honest_kernel_passes_against_a_clients_reference_as_against_the_served_task(service):
    # Mutation: reference_child._take hands forward a view of the arena rather than a copy (the outputs,
    # written from offset 0, overwrite the inputs) -> the expected outputs are wrong and the kernel fails;
    # or Baselines._measure times a jailed reference in the baseline process again -> the note below.
    running, _, _ = service
    client = VerifierClient(running.url, TOKEN)
    jailed = client.verify(RELU_SOLUTION, reference=RELU_TASK)
    served = client.verify(RELU_SOLUTION, task_id="level1/01_relu")
    assert jailed.task_id.startswith("inline/") and served.task_id == "level1/01_relu"
    assert (jailed.passed, jailed.error_class) == (served.passed, served.error_class) == (True, None), (
        jailed.feedback,
        served.feedback,
    )
    assert jailed.speedup_eager is not None and jailed.speedup_eager > 0  # its baseline, timed in its jail
    assert "verifier's process" not in json.dumps(jailed.diagnostics)


@pytest.mark.parametrize("where", ["import", "get_inputs", "forward", "kernelgym"])
def test_a_hostile_clients_reference_is_confined_and_its_failure_is_the_references(service, host, where):
    # Mutation: ReferenceCache.jailed ignores `reference_origin` (or app.inline_task leaves it
    # "task_set") -> the probe runs in the verifier's process: it reads the token file (the secret comes
    # back in the feedback), writes the host's file, connects, sees the host's processes, kills the
    # victim and runs the shell. Mutation: reference_child drops the stacked process filter -> "ran".
    running, _, _ = service
    probe, tmp_path, listener, victim = host
    source = (
        probe
        + {
            "import": small_reference(at_import="_probe()"),
            "get_inputs": small_reference(in_inputs="_probe()"),
            "forward": small_reference(in_forward="_probe()"),
            "kernelgym": small_reference(at_import="_probe()"),
        }[where]
    )
    if where == "kernelgym":
        answer = post(
            running.url, "/evaluate", {"task_id": "kg-1", "reference_code": source, "kernel_code": RELU_SOLUTION}
        )
        assert answer["status"] == "failed" and answer["error_code"] == "SYSTEM_ERROR", answer
        text, feedback = json.dumps(answer), answer["error_message"]
    else:
        r = VerifierClient(running.url, TOKEN).verify(RELU_SOLUTION, reference=source)
        assert (r.error_class, r.score, r.stage) == ("infra", 0.0, "run"), r.feedback  # not the candidate's -1
        text, feedback = json.dumps({"feedback": r.feedback, "diagnostics": r.diagnostics}), r.feedback
    # the probe ran (its outcomes are in the one-line reason) and every attempt was refused
    assert "read:" in feedback and "\n" not in feedback and "Traceback" not in feedback, feedback
    assert TOKEN not in text and "secret:" not in text
    assert not (tmp_path / "written").exists() and not (tmp_path / "ran").exists()
    assert "connected" not in feedback
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert "pids:1 " in feedback and "killed" not in feedback and victim.poll() is None
    assert "run:PermissionError" in feedback


def test_a_reference_that_crashes_hangs_or_replies_garbage_is_one_line_and_the_next_request_is_served(service):
    running, _, _ = service
    client = VerifierClient(running.url, TOKEN)
    faults = {
        # Mutation: JailedProgram._exchange lets PeerClosed escape as a WireError that verify() does not
        # know -> an infra line with a traceback logged, or the lane's cache keeps the dead process.
        "crash": (small_reference(in_inputs="import ctypes; ctypes.string_at(0)"), "SIGSEGV"),
        # Mutation: the request's deadline dropped (wire.recv(..., None, ...)) -> this request never ends.
        "hang": (small_reference(in_forward="import time; time.sleep(3600)"), "did not answer within 3 s"),
        # Mutation: wire.recv without max_bytes in _exchange -> the verifier waits for 2 GB that never come.
        "garbage": (
            small_reference(
                at_import="import os\nfor fd in os.listdir('/proc/self/fd'):\n"
                "    if os.path.islink(f'/proc/self/fd/{fd}') and os.readlink(f'/proc/self/fd/{fd}').startswith('socket:'):\n"
                "        os.write(int(fd), b'\\xff\\xff\\xff\\x7f')"
            ),
            "malformed",
        ),
    }
    for name, (source, words) in faults.items():
        r = client.verify(RELU_SOLUTION, reference=source)
        assert (r.error_class, r.score) == ("infra", 0.0), (name, r.feedback)
        assert words in r.feedback and "\n" not in r.feedback and "Traceback" not in r.feedback, (name, r.feedback)
    # The service keeps serving, the honest reference's process included (a distinct candidate source:
    # no verdict-cache hit, the same build).
    after = client.verify(RELU_SOLUTION + "\n# after the faults\n", reference=RELU_TASK)
    assert after.passed, after.feedback


def test_concurrent_runs_of_one_clients_reference_all_finish(service):
    # Several runs of one client's reference at once: while one has its baselines timed (the
    # exclusive lease held on the child's behalf), the others draw and run forward under the shared
    # lease. Mutation: time the baselines in the program's own process again (JailedProgram.baselines
    # calling _time_baselines on self) -> the measurement holds the program's lock while it waits for
    # the exclusive lease, the others hold the shared lease while they wait for that lock: every call
    # hangs until the service's deadline (a two-step demo against `kiln serve` hung so).
    running, _, _ = service
    client = VerifierClient(running.url, TOKEN)
    reference = small_reference(at_import="# concurrent runs")  # a source no other test sent: fresh baselines
    results = [None] * 3

    def one(i: int) -> None:
        results[i] = client.verify(RELU_SOLUTION + f"\n# run {i}\n", reference=reference, deadline_s=90)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None and r.passed for r in results), [r and r.feedback for r in results]
