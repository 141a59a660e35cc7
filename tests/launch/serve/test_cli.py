"""`kiln serve` as its own process, with the kernel verifier behind it: the token rule at start-up,
and a real candidate compiled, run and timed on the cpu backend for a client over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocols.verifier_client import VerifierClient

ROOT = Path(__file__).resolve().parents[3]


def kiln(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "serve", *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_off_loopback_without_a_token_file_it_refuses_to_start_in_one_line(host):
    # Mutation: drop the check in auth.Tokens -> the service binds everywhere with no token.
    proc = kiln("--host", host, "--port", "0")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert err.strip().count("\n") == 0 and f"serve.host {host} is not loopback: set serve.token_file" in err


def test_an_unreadable_token_file_is_one_line(tmp_path):
    proc = kiln("--token-file", str(tmp_path / "missing"), "--port", "0")
    _, err = proc.communicate(timeout=120)
    assert (
        proc.returncode == 2
        and err.strip() == f"kiln serve: cannot read serve.token_file {tmp_path / 'missing'}: No such file or directory"
    )


def test_a_real_kernel_verified_over_http_by_the_kernel_verifier(tmp_path, verifier_cache_dir):
    tokens = tmp_path / "tokens"
    tokens.write_text("trainer trainer-token-0123456789\n")
    proc = kiln(
        "--port", "0", "--token-file", str(tokens), "--backend", "cpu", f"verifier.cache_dir={verifier_cache_dir}"
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("kiln serve: listening on http://127.0.0.1:"), (
            line,
            proc.stderr.read() if proc.poll() is not None else "",
        )
        url = line.split()[4]
        client = VerifierClient(url, "trainer-token-0123456789")
        solution = (ROOT / "tasks/solutions/cpu/level1/01_relu.py").read_text()
        r = client.verify(solution, task_id="level1/01_relu")
        assert r.passed and r.error_class is None and r.score >= 1.0, r.feedback
        assert r.speedup_eager is not None and r.speedup_eager > 0
        assert r.timings.get("compile") is not None or r.cached
        assert "toolchain" not in r.diagnostics  # redacted for a remote client
        wrong = solution.replace("v > 0.0f ? v : 0.0f", "v > 0.0f ? v : 0.5f")
        assert wrong != solution
        bad = client.verify(wrong, task_id="level1/01_relu")
        assert not bad.passed and bad.error_class == "correctness" and bad.score < 0  # q-scaled: some trials pass
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0
