"""`kiln serve` over real HTTP (launch/serve): every endpoint, the token rule, the limits,
backpressure, deadlines, KernelGYM's shapes, a verifier stopped mid-request, and bad input answered
in one line while the server keeps serving. The verifiers here run a paced stand-in reward actor
(paced.py) in real VerifierActors, so a test can hold a job for as long as it needs; the kernel
verifier behind the same server is test_cli.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.request

import pytest

from configs import load_config
from launch.serve.cli import start
from protocols import VerifyRequest, VerifyResult
from protocols.verifier_client import AsyncVerifierClient, ServiceError, ServiceTimeout, VerifierClient

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-9876543210xx"}
REFERENCE = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"


def _config(tmp_path, *overrides: str):
    tokens = tmp_path / "tokens"
    tokens.write_text("# name token\n" + "".join(f"{n} {t}\n" for n, t in TOKENS.items()))
    return load_config(
        None,
        [
            "verifier.reward_actor=tests.launch.serve.paced.PacedReward",
            "verifier.max_concurrent_requests=1",
            "serve.port=0",
            f"serve.token_file={tokens}",
            "serve.verifiers=2",
            "serve.queue_capacity=4",
            "serve.client_share=3",
            "serve.batch_max=3",
            "serve.max_body_bytes=65536",
            "serve.max_source_chars=2000",
            "serve.retry_after_s=1",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start(_config(tmp_path_factory.mktemp("serve")))
    yield running
    running.stop()


def raw(server, method: str, path: str, body: bytes | None = None, token: str | None = TOKENS["alice"]):
    """(status, headers, JSON or text) of one real HTTP exchange."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(server.url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, head, text = resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, head, text = err.code, err.headers, err.read().decode()
    try:
        return status, head, json.loads(text)
    except json.JSONDecodeError:
        return status, head, text


def post(server, path: str, body, token=TOKENS["alice"]):
    return raw(server, "POST", path, json.dumps(body).encode(), token)


def test_a_verdict_over_http_in_the_versioned_schema_with_host_details_redacted(server):
    client = VerifierClient(server.url, TOKENS["alice"])
    r = client.verify("pass", reference=REFERENCE)
    assert (r.passed, r.score, r.stage, r.feedback) == (True, 1.0, "done", "ok")
    assert r.task_id.startswith("inline/")
    status, _, body = post(server, "/v1/verify", {"candidate": "wrong", "reference": REFERENCE})
    assert status == 200 and body["status"] == "done"
    verdict = body["verdict"]
    assert verdict["schema"] == 1 and verdict["error_class"] == "correctness" and verdict["score"] == -1.0
    # Mutation: to_json(..., remote=False) in app._job_json -> the toolchain and the machine's memory leak.
    assert "toolchain" not in verdict["diagnostics"]
    assert verdict["diagnostics"]["sandbox"]["limits"] == {"memory_mb": 512}
    assert "secret-flags" not in json.dumps(body)


def test_a_task_of_the_served_set_by_id_and_an_unknown_one(server):
    r = VerifierClient(server.url, TOKENS["alice"]).verify("pass", task_id="level1/01_relu")
    assert r.task_id == "level1/01_relu" and r.passed
    status, _, body = post(server, "/v1/verify", {"candidate": "pass", "task_id": "level9/none"})
    assert status == 404 and "unknown task_id 'level9/none'" in body["error"]


def test_the_token_rule(server):
    status, _, body = post(server, "/v1/verify", {"candidate": "pass", "reference": REFERENCE}, token=None)
    assert status == 401 and "token is required" in body["error"]
    status, _, _ = post(server, "/v1/verify", {"candidate": "pass", "reference": REFERENCE}, token="not-a-token-at-all")
    assert status == 401
    assert raw(server, "GET", "/metrics", token=None)[0] == 401
    status, _, health = raw(server, "GET", "/health", token=None)  # open: a load balancer probes it
    assert status == 200 and health["status"] == "healthy" and health["verifiers"] == 2


def test_a_batch_is_bounded_and_answered_in_order(server):
    client = VerifierClient(server.url, TOKENS["alice"])
    got = client.verify_batch(
        [{"candidate": "pass", "reference": REFERENCE}, {"candidate": "no", "reference": REFERENCE}]
    )
    assert [r.passed for r in got] == [True, False]
    status, _, body = post(
        server, "/v1/verify/batch", {"requests": [{"candidate": "pass", "reference": REFERENCE}] * 4}
    )
    assert status == 413 and "at most 3 requests, not 4" in body["error"]
    status, _, body = post(
        server, "/v1/verify/batch", {"requests": [{"candidate": "pass", "reference": REFERENCE}, {"candidate": 3}]}
    )
    assert status == 400 and body["error"].startswith("requests[1]: ")


def test_submit_then_poll_and_another_clients_job_is_unknown(server):
    alice, bob = VerifierClient(server.url, TOKENS["alice"]), VerifierClient(server.url, TOKENS["bob"])
    job_id = alice.submit("sleep 0.5 pass", reference=REFERENCE)
    assert alice.result(job_id) is None  # still running
    with pytest.raises(ServiceError) as err:
        bob.result(job_id)
    assert err.value.status == 404
    r = alice.result(job_id, wait_s=10, poll_s=0.1)
    assert r is not None and r.passed


def test_a_deadline_answers_in_one_line_and_cancels_the_work(server):
    # The client gets its one line at the deadline, and the verifier's work on it is cancelled (the
    # reward actor's cancel hook): the verifier is free again long before the 30 s the call asked for.
    # Mutation: drop the `_cancel` calls in Dispatcher._watch -> no call is cancelled, both verifiers
    # stay busy for 30 s and the next request waits past its own deadline.
    client = VerifierClient(server.url, TOKENS["bob"])
    started = time.monotonic()
    for _ in range(2):  # both verifiers take one (serve.verifiers=2, one call each)
        with pytest.raises(ServiceTimeout, match="deadline passed"):
            client.verify("sleep 30 pass", reference=REFERENCE, deadline_s=0.5)
    assert time.monotonic() - started < 4.0
    assert client.verify("pass", reference=REFERENCE, deadline_s=5).passed
    assert "kiln_serve_cancelled_total 2" in raw(server, "GET", "/metrics")[2]
    assert sum(len(a.impl.cancelled) for a in server.verifiers.actors) == 2
    status, _, body = post(
        server, "/v1/verify", {"candidate": "pass", "reference": REFERENCE, "deadline_s": -1}, token=TOKENS["bob"]
    )
    assert status == 400 and "deadline_s must be a number" in body["error"]


def test_backpressure_is_a_429_with_retry_after(server):
    # Two verifiers hold two jobs; the queue takes 4 more, alice's share 3 of them.
    alice = VerifierClient(server.url, TOKENS["alice"], busy_retries=0)
    bob = VerifierClient(server.url, TOKENS["bob"], busy_retries=0)
    held = [alice.submit("sleep 1.5 pass", reference=REFERENCE) for _ in range(2)]
    time.sleep(0.3)  # both running now
    queued = [alice.submit("pass", reference=REFERENCE) for _ in range(3)]
    status, head, body = post(server, "/v1/jobs", {"candidate": "pass", "reference": REFERENCE})
    assert status == 429 and head["Retry-After"] == "1" and "retry after 1 s" in body["error"]
    queued.append(bob.submit("pass", reference=REFERENCE))  # bob still has room: his share is his own
    status, _, _ = post(server, "/v1/jobs", {"candidate": "pass", "reference": REFERENCE}, token=TOKENS["bob"])
    assert status == 429  # now the whole queue is full
    # A client that waits as Retry-After says gets in.
    patient = VerifierClient(server.url, TOKENS["bob"], busy_retries=5)
    assert patient.verify("pass", reference=REFERENCE).passed
    for job_id in held + queued[:3]:
        assert alice.result(job_id, wait_s=15, poll_s=0.1).passed
    text = raw(server, "GET", "/metrics")[2]
    assert "kiln_serve_queue_depth 0" in text and 'kiln_serve_verdicts_total{verdict="pass"}' in text
    assert "kiln_serve_latency_seconds_count" in text


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "a JSON object"),
        (json.dumps({"candidate": "pass"}).encode(), 400, "give the reference"),
        (json.dumps({"candidate": 7, "reference": REFERENCE}).encode(), 400, "candidate is required"),
        (json.dumps({"candidate": "x" * 2001, "reference": REFERENCE}).encode(), 413, "max_source_chars"),
        (b'{"candidate": "' + b"x" * 70000 + b'"}', 413, "max_body_bytes"),
        (
            json.dumps({"candidate": "pass", "reference": REFERENCE, "task_id": "level1/01_relu"}).encode(),
            400,
            "one of them",
        ),
    ],
)
def test_bad_input_is_one_line_and_the_server_keeps_serving(server, body, status, words):
    got, _, answer = raw(server, "POST", "/v1/verify", body)
    assert got == status and isinstance(answer, dict) and words in answer["error"], answer
    assert "\n" not in answer["error"] and "Traceback" not in answer["error"]
    assert raw(server, "GET", "/health")[0] == 200


def test_kernelgym_shaped_calls(server):
    req = {
        "task_id": "kg-1",
        "reference_code": REFERENCE,
        "kernel_code": "pass",
        "backend": "cuda",
        "num_perf_trials": 50,
        "timeout": 60,
    }
    status, _, body = post(server, "/evaluate", req)
    assert status == 200
    assert (body["task_id"], body["status"], body["compiled"], body["correctness"], body["decoy_kernel"]) == (
        "kg-1",
        "completed",
        True,
        True,
        False,
    )
    assert body["metadata"]["requested"]["num_perf_trials"] == 50  # accepted and reported, Kiln's protocol decides
    assert post(server, "/status/kg-1", None)[0] == 405
    assert raw(server, "GET", "/status/kg-1")[2] == {"task_id": "kg-1", "status": "completed"}
    assert raw(server, "GET", "/results/kg-1")[2]["correctness"] is True
    assert raw(server, "GET", "/results/kg-1", token=TOKENS["bob"])[0] == 404
    wrong = {**req, "task_id": "kg-2", "kernel_code": "wrong answer"}
    batch = post(server, "/evaluate/batch", {"batch_id": "b", "tasks": [dict(req, task_id="kg-3"), wrong]})[2]
    assert (batch["total_tasks"], batch["completed_tasks"], batch["failed_tasks"]) == (2, 2, 0)
    assert [r["error_code"] for r in batch["results"]] == [None, "CORRECTNESS_ERROR"]
    status, _, body = post(server, "/evaluate", {**req, "task_id": "kg-4", "backend": "triton"})
    assert status == 400 and "Triton" in body["error"]
    status, _, body = post(server, "/evaluate/batch", {"batch_id": "b", "tasks": [req] * 101})
    assert status == 413
    status, _, body = post(server, "/evaluate", {**req, "num_warmup": "three"})
    assert status == 400 and "num_warmup has the wrong type" in body["error"]


def test_the_asyncio_client(server):
    async def main():
        client = AsyncVerifierClient(server.url, TOKENS["bob"])
        try:
            got = await asyncio.gather(*(client.verify("pass", reference=REFERENCE) for _ in range(3)))
            job_id = await client.submit("no", reference=REFERENCE)
            late = await client.result(job_id, wait_s=10, poll_s=0.05)
            return got, late
        finally:
            await client.close()

    got, late = asyncio.run(main())
    assert [r.passed for r in got] == [True] * 3 and late.error_class == "correctness"


def kill_the_holder_mid_request(running, kill, sleep_s: float) -> VerifyResult:
    """A job that takes `sleep_s`, its verifier killed (`kill(index)`) while it holds it; its verdict."""
    client = VerifierClient(running.url, TOKENS["alice"])
    out = {}
    waiter = threading.Thread(target=lambda: out.update(r=client.verify(f"sleep {sleep_s} pass", reference=REFERENCE)))
    waiter.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(running.verifiers.turns.holding()):
        time.sleep(0.02)
    time.sleep(0.3)  # the call is in the verifier now
    kill(running.verifiers.turns.holding().index(1))
    waiter.join(timeout=30)
    return out["r"]


def test_a_verifier_stopped_mid_request_loses_nothing(tmp_path):
    # Its own server: it stops one of its two verifiers. The job it held is retried once, on the other.
    running = start(_config(tmp_path))
    try:
        r = kill_the_holder_mid_request(running, running.verifiers.stop, 2)
        assert r.passed  # answered by the other verifier
        assert "kiln_serve_retried_total 1" in raw(running, "GET", "/metrics")[2]
        assert raw(running, "GET", "/health")[2]["verifiers"] == 1
    finally:
        running.stop()


def test_a_ray_verifier_killed_mid_request_loses_nothing_and_is_replaced(tmp_path, ray_session):
    # serve.pool: ray. The actor holding the job is killed (ray.kill): the job is retried once on the
    # other, answered in full, and the dead one is replaced. Mutation: re-raise RayActorError in
    # RayVerifiers.verify instead of WorkerDied -> the job is answered infra, not retried.
    running = start(_config(tmp_path, "serve.pool=ray"))
    try:
        r = kill_the_holder_mid_request(running, running.verifiers.kill, 3)
        assert r.passed and r.score == 1.0
        assert "kiln_serve_retried_total 1" in raw(running, "GET", "/metrics")[2]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and running.verifiers.live() < 2:
            time.sleep(0.2)
        assert running.verifiers.live() == 2  # the fleet kept its size
        client = VerifierClient(running.url, TOKENS["alice"])
        assert client.verify("pass", reference=REFERENCE).passed
        # A deadline cancels a Ray actor's work too (its cancel, called through Ray): both actors busy
        # for 30 s would leave the last call waiting past its own deadline.
        for _ in range(2):
            with pytest.raises(ServiceTimeout):
                client.verify("sleep 30 pass", reference=REFERENCE, deadline_s=0.5)
        assert client.verify("pass", reference=REFERENCE, deadline_s=10).passed
    finally:
        running.stop()


def test_the_verl_and_trl_adapters_called_as_those_trainers_call_them(server, monkeypatch):
    # verl is not installed here (it pulls a large stack): its adapter is driven through the call verl
    # documents; its reward manager calls compute_score(data_source=, solution_str=, ground_truth=,
    # extra_info=) and reads "score". TRL's GRPOTrainer calls each reward function with prompts=,
    # completions= and the dataset's columns (test_trl.py drives it with TRL's own trainer); here its
    # error policy: a deadline scores on_error, a refusal of the caller's mistake raises.
    from protocols import verifier_adapters

    monkeypatch.setenv("KILN_SERVE_URL", server.url)
    monkeypatch.setenv("KILN_SERVE_TOKEN", TOKENS["bob"])
    got = verifier_adapters.compute_score(
        data_source="kernelbench", solution_str="pass", ground_truth=REFERENCE, extra_info={"index": 0}
    )
    assert got["score"] == 1.0 and got["passed"] == 1.0
    named = verifier_adapters.compute_score("kernelbench", "wrong", None, {"task_id": "level1/01_relu"})
    assert named["score"] == -1.0 and named["error_class"] == "correctness"
    reward = verifier_adapters.TrlReward()
    scores = reward(
        prompts=[[{"role": "user", "content": "write it"}]] * 3,
        completions=[
            [{"role": "assistant", "content": "pass"}],
            [{"role": "assistant", "content": "nope"}],
            [{"role": "assistant", "content": "sleep 0.2 pass"}],
        ],
        reference=[REFERENCE] * 3,
        task_id=[None, None, None],
    )
    assert scores[:2] == [1.0, -1.0] and scores[2] == 1.0 and reward.__name__ == "kiln_verifier"
    reward.deadline_s = 0.3  # the call's deadline passes: the sample is not judged
    assert reward(completions=["sleep 2 pass"], reference=[REFERENCE]) == [0.0]
    with pytest.raises(ServiceError, match="unknown task_id"):  # a task the service does not serve: a mistake
        reward(completions=["pass"], task_id=["level9/none"])
    monkeypatch.delenv("KILN_SERVE_URL")
    with pytest.raises(RuntimeError, match="set KILN_SERVE_URL"):
        verifier_adapters.TrlReward()


def test_the_rollout_actors_front_to_a_service(server, monkeypatch):
    # verifier.remote: the verdict under the attempt's own ids; a service that does not answer in time,
    # or at all, is resent rollout.verify_retries times and then infra (the system's fault, never -1).
    from actors.rollout.remote_verifier import RemoteVerifier
    from launch.serve.app import inline_task

    monkeypatch.setenv("KILN_SERVE_TOKEN", TOKENS["bob"])
    task = dataclasses.replace(inline_task(REFERENCE, "cpu"), task_id="level9/mine")

    async def main():
        fronts = [
            RemoteVerifier(server.url, timeout_s=10, retries=1),
            RemoteVerifier(server.url, timeout_s=0.3, retries=1),
            RemoteVerifier("http://127.0.0.1:9", timeout_s=5, retries=2),
        ]
        try:
            return [
                await front.verify(VerifyRequest(request_id=f"ep/t{i}", task=task, candidate=text))
                for i, (front, text) in enumerate(zip(fronts, ["pass", "sleep 1 pass", "pass"], strict=True))
            ], [f.stats for f in fronts]
        finally:
            for f in fronts:
                await f.close()

    (ok, late, away), stats = asyncio.run(main())
    assert (ok.request_id, ok.task_id, ok.passed, ok.score) == ("ep/t0", "level9/mine", True, 1.0)
    assert late.error_class == "infra" and late.score == 0.0 and "deadline passed" in late.feedback
    assert away.error_class == "infra" and "cannot reach" in away.feedback
    assert stats[1] == {"sent": 1, "infra": 1, "resent": 1} and stats[2]["resent"] == 2
    time.sleep(1.0)  # the late job's verdicts end before the next test counts workers
