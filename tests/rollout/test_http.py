"""The engine's SGLang-subset HTTP server and the client: every endpoint Kiln calls, bad requests,
the client's parsing of SGLang's own response shape, and the client driving two embedded engines
through the real `sglang-router` (PyPI sglang-router, Rust, runs on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from safetensors.torch import save_file

from actors.policy.model import build_model
from actors.policy.tokenizer import ByteTokenizer
from actors.policy.weights.group import WeightBroadcaster, manifest
from actors.rollout.engine import EngineError, GenerateRequest, SamplingParams
from actors.rollout.http_client import SGLangClient, parse_generation
from actors.rollout.http_server import EngineServer
from actors.rollout.torch_engine import TorchEngine
from configs import ModelConfig
from tests.helpers.common import free_port, reference_logprobs

TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=256)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# A /generate response in SGLang's shape (python/sglang/srt/managers/tokenizer_manager.py and
# schedule_batch.py finish reasons, SGLang 0.5.x): logprob triples (logprob, token id, text or None),
# finish_reason as a typed dict, weight_version as a string; no Kiln extensions.
SGLANG_GENERATE_RESPONSE = {
    "text": "ab",
    "output_ids": [97, 98],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "e2e_latency": 0.05,
        "weight_version": "4",
        "output_token_logprobs": [[-0.5, 97, None], [-1.25, 98, None]],
    },
}


def post(url, path, body: bytes):
    req = urllib.request.Request(url + path, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.fixture(scope="module")
def served():
    engine = TorchEngine(TINY, max_batch=4, eos_token_ids=[257], seed=3)
    server = EngineServer(engine, decode=ByteTokenizer().decode)
    server.start()
    yield engine, server, SGLangClient(server.url, timeout_s=60)
    server.stop()
    engine.close()


def test_probe_endpoints_answer_like_sglang(served):
    _engine, _server, client = served
    assert client.health().alive
    info = client.call("GET", "/model_info")
    assert info["is_generation"] is True and set(info) >= {"model_path", "tokenizer_path"}
    assert client.call("GET", "/get_model_info") == info
    assert client.call("GET", "/server_info")["weight_version"] == "0"
    assert client.call("GET", "/v1/models")["data"]


def test_generate_single_and_batched_with_exact_logprobs(served):
    engine, server, client = served
    body = {
        "input_ids": [[256, 1, 2], [256, 3]],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "top_k": -1},
    }
    status, raw = post(server.url, "/generate", json.dumps(body).encode())
    out = json.loads(raw)
    assert status == 200 and isinstance(out, list) and len(out) == 2
    for prompt, item in zip(body["input_ids"], out, strict=True):
        meta = item["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        ids = [t for _, t, _ in meta["output_token_logprobs"]]
        assert ids == item["output_ids"] and meta["completion_tokens"] == 5
        lps = np.array([lp for lp, _, _ in meta["output_token_logprobs"]])
        assert np.abs(reference_logprobs(engine.model, prompt, ids) - lps).mean() < 1e-4
    (gen,) = client.generate([GenerateRequest("one", [256, 4], SamplingParams(max_new_tokens=3, ignore_eos=True))])
    assert gen.request_id == "one" and len(gen.output_ids) == 3 and gen.versions.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "body,message",
    [
        (b"{not json", "Expecting"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"input_ids": []}).encode(), "non-empty"),
        (json.dumps({"text": "hi"}).encode(), "input_ids"),
        (json.dumps({"input_ids": [256, "a"]}).encode(), "integers"),
        (json.dumps({"input_ids": [256], "sampling_params": {"temperature": -1}}).encode(), "temperature"),
        (json.dumps({"input_ids": [256], "sampling_params": {"frequency_penalty": 0.5}}).encode(), "not supported"),
        (json.dumps({"input_ids": [256, 100000]}).encode(), "vocabulary"),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(served, body, message):
    _engine, server, client = served
    status, raw = post(server.url, "/generate", body)
    assert status == 400 and message in json.loads(raw)["error"]["message"]
    assert client.health().alive


def test_weight_update_pause_continue_and_memory_endpoints(served, tmp_path):
    engine, server, client = served
    new = build_model(ModelConfig(**{**{f: getattr(TINY, f) for f in TINY.__dataclass_fields__}, "seed": 5}))
    save_file(
        {k: v.contiguous() for k, v in new.state_dict().items() if k != "lm_head.weight"},
        str(tmp_path / "model.safetensors"),
    )
    client.pause()
    client.resume()
    status, raw = post(server.url, "/pause_generation", json.dumps({"mode": "retract"}).encode())
    assert status == 400 and "retract" in json.loads(raw)["error"]["message"]
    assert not engine.health().paused
    client.release_memory()
    client.resume_memory()
    client.update_weights_from_disk(str(tmp_path), version=2)
    assert client.weight_version == 2 == engine.weight_version
    (gen,) = client.generate([GenerateRequest("w", [256, 6], SamplingParams(max_new_tokens=4, ignore_eos=True))])
    assert gen.versions.tolist() == [2] * 4
    assert np.abs(reference_logprobs(new, [256, 6], gen.output_ids.tolist()) - gen.logprobs).mean() < 1e-4
    with pytest.raises(EngineError, match="success"):
        client.update_weights_from_disk(str(tmp_path / "missing"), version=3)
    assert engine.weight_version == 2


def test_distributed_weight_update_over_http_with_a_gloo_broadcaster(served):
    engine, _server, client = served
    new = build_model(ModelConfig(**{**{f: getattr(TINY, f) for f in TINY.__dataclass_fields__}, "seed": 8}))
    tensors = [(k, v) for k, v in new.state_dict().items() if k != "lm_head.weight"]
    names, dtypes, shapes = manifest(tensors)
    port = free_port()
    learner = threading.Thread(target=lambda: WeightBroadcaster("127.0.0.1", port, 2, timeout_s=30).broadcast(tensors))
    learner.start()
    client.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
    client.update_weights_from_distributed(names, dtypes, shapes, version=9)
    learner.join(30)
    assert client.weight_version == 9 == engine.weight_version
    (gen,) = client.generate([GenerateRequest("d", [256, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))])
    assert gen.versions.tolist() == [9] * 4
    assert np.abs(reference_logprobs(new, [256, 7], gen.output_ids.tolist()) - gen.logprobs).mean() < 1e-4
    with pytest.raises(EngineError, match="no weight group"):
        client.update_weights_from_distributed(names, dtypes, shapes, version=10, group_name="missing")
    with pytest.raises(EngineError, match="missing field"):
        client.call("POST", "/init_weights_update_group", {"master_port": 1})


def test_client_parses_sglangs_own_response_shape():
    req = GenerateRequest("r1", [1, 2, 3])
    gen = parse_generation(req, SGLANG_GENERATE_RESPONSE)
    assert gen.output_ids.tolist() == [97, 98] and gen.logprobs.tolist() == [-0.5, -1.25]
    assert gen.versions.tolist() == [4, 4] and gen.finish_reason == "length" and gen.truncated
    with pytest.raises(EngineError, match="malformed"):
        parse_generation(req, {"meta_info": {}})


def router_healthy_workers(port: int) -> int:
    """How many workers the router itself counts as healthy (its /readiness answer); 0 while it starts."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=2) as reply:
            return int(json.loads(reply.read()).get("healthy_workers", 0))
    except (OSError, ValueError):
        return 0


@pytest.fixture
def router():
    engines = [TorchEngine(TINY, max_batch=4, eos_token_ids=[257], seed=i) for i in range(2)]
    servers = [EngineServer(e) for e in engines]
    for s in servers:
        s.start()
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *[s.url for s in servers],
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(free_port()),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=60)
    try:
        # Wait on the router's own view of its workers, not on its process: under load a worker is
        # admitted after the router already answers, and round-robin over one worker sends it everything.
        deadline = time.monotonic() + 60
        while router_healthy_workers(port) < len(servers):
            assert proc.poll() is None and time.monotonic() < deadline, "sglang-router did not admit both workers"
            time.sleep(0.2)
        yield client, engines, servers
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        client.close()
        for s, e in zip(servers, engines, strict=True):
            s.stop()
            e.close()


def test_client_through_the_real_sglang_router_to_two_embedded_engines(router):
    client, engines, _servers = router
    reqs = [
        GenerateRequest(f"r{i}", [256, i, i + 1], SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(8)
    ]
    gens = client.generate(reqs)
    assert [g.request_id for g in gens] == [r.request_id for r in reqs]
    served = [e.stats["requests"] for e in engines]
    assert sum(served) == 8 and min(served) >= 2  # the router spread the requests over both engines
    # Both engines hold the same seed-0 weights, so every logprob checks against one reference model.
    model = engines[0].model
    for req, gen in zip(reqs, gens, strict=True):
        assert len(gen.output_ids) == 4 and gen.finish_reason == "length"
        assert np.abs(reference_logprobs(model, req.prompt_ids, gen.output_ids.tolist()) - gen.logprobs).mean() < 1e-4
