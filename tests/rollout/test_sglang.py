"""The `sglang` engine without SGLang: the launch command from the config, a launched server process
(Kiln's embedded engine standing in through `rollout.sglang.launch_module`), a launch that fails, and
the distributed weight-update requests against a fixture that answers like SGLang's endpoints
(request fields from SGLang's io_struct: InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput; responses {"success", "message"})."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from actors.policy.model import build_model
from actors.rollout.engine import EngineError, GenerateRequest, SamplingParams
from actors.rollout.engines import make_engine
from actors.rollout.sglang_engine import SGLangEngine, launch_spec
from configs import ModelConfig, RolloutConfig, SGLangConfig, load_config
from launch.driver.plan import actor_slot, plan
from tests.helpers.common import free_port

TINY = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=256)

INIT_GROUP_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
UPDATE_DISTRIBUTED_FIELDS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version"}


def test_launch_command_comes_from_the_config():
    rollout = RolloutConfig(
        engine="sglang",
        sglang=SGLangConfig(tp_size=2, mem_fraction=0.6, base_port=31000, extra_args=["--dtype", "bfloat16"]),
    )
    slot = actor_slot(
        plan(
            load_config(
                None,
                ["rollout.engine=sglang", "rollout.sglang.tp_size=2", "rollout.num_actors=2", "cluster.engine_gpus=2"],
            ),
            check_fit=False,
        ),
        "rollout",
        1,
    )
    spec = launch_spec(rollout, dataclasses.replace(TINY, path="/models/qwen"), index=1, gpu_ids=slot.device_ids())
    cmd = spec.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model-path"] == "/models/qwen" and flags["--port"] == "31001" and flags["--tp-size"] == "2"
    assert flags["--mem-fraction-static"] == "0.6" and "--skip-tokenizer-init" in cmd
    assert cmd[-2:] == ["--dtype", "bfloat16"]
    assert spec.env()["CUDA_VISIBLE_DEVICES"] == "2,3"  # the plan gives actor 1 of TP 2 GPUs 2 and 3
    with pytest.raises(EngineError, match="tp_size=2 but the placement gives this actor 1 GPUs"):
        launch_spec(rollout, dataclasses.replace(TINY, path="/models/qwen"), index=1, gpu_ids=("5",))
    with pytest.raises(EngineError, match="model.path"):
        launch_spec(rollout, TINY, index=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ckpt")
    model = build_model(TINY)
    model.save_pretrained(str(path))
    return path, model


def test_a_launched_server_serves_exact_logprobs_and_stops_with_the_engine(checkpoint):
    path, model = checkpoint
    rollout = RolloutConfig(
        engine="sglang",
        sglang=SGLangConfig(launch_module="actors.rollout.serve", base_port=free_port(), start_timeout_s=120.0),
    )
    engine = make_engine(rollout, dataclasses.replace(TINY, path=str(path)), index=0, eos_token_ids=[])
    try:
        assert isinstance(engine, SGLangEngine) and engine.health().alive
        prompt = [256, 10, 20, 30]
        (gen,) = engine.generate(
            [GenerateRequest("a", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8))]
        )
        ids = torch.tensor([prompt + gen.output_ids.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(gen.output_ids)[:, None])[:, 0].numpy()
        assert np.abs(ref - gen.logprobs).mean() < 1e-4
        assert engine.weight_version == 0
    finally:
        engine.close()
    assert engine.server.proc.poll() is not None


def test_a_server_that_fails_to_start_is_an_engine_error(tmp_path):
    rollout = RolloutConfig(
        engine="sglang",
        sglang=SGLangConfig(launch_module="actors.rollout.no_such_module", base_port=free_port(), start_timeout_s=60.0),
    )
    with pytest.raises(EngineError, match="exited"):
        make_engine(rollout, dataclasses.replace(TINY, path=str(tmp_path)), index=0, eos_token_ids=[])


class SGLangWeightFixture:
    """Answers the weight-update endpoints the way SGLang's http_server does ({"success", "message"},
    HTTP 400 on failure) and records each request body."""

    def __init__(self, succeed: bool = True) -> None:
        self.bodies: dict[str, dict] = {}
        fixture = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fixture.bodies[self.path] = body
                out = json.dumps({"success": succeed, "message": "ok" if succeed else "group not initialised"})
                self.send_response(200 if succeed else 400)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out.encode())

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_distributed_weight_update_requests_match_sglangs_request_types():
    fixture = SGLangWeightFixture()
    engine = SGLangEngine(
        RolloutConfig(engine="sglang", sglang=SGLangConfig(urls=[fixture.url])), TINY, index=0, eos_token_ids=[]
    )
    try:
        engine.init_weights_update_group("10.0.0.1", 29600, rank_offset=1, world_size=3)
        init = fixture.bodies["/init_weights_update_group"]
        assert set(init) == INIT_GROUP_FIELDS
        assert init == {
            "master_address": "10.0.0.1",
            "master_port": 29600,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "weight_update_group",
            "backend": "nccl",
        }
        engine.update_weights_from_distributed(["model.norm.weight"], ["bfloat16"], [[64]], version=7)
        update = fixture.bodies["/update_weights_from_distributed"]
        assert set(update) == UPDATE_DISTRIBUTED_FIELDS
        assert update["names"] == ["model.norm.weight"] and update["shapes"] == [[64]]
        assert update["weight_version"] == "7"  # SGLang keeps weight versions as strings
    finally:
        engine.close()
        fixture.close()


def test_a_refused_distributed_update_is_an_engine_error():
    fixture = SGLangWeightFixture(succeed=False)
    engine = SGLangEngine(
        RolloutConfig(engine="sglang", sglang=SGLangConfig(urls=[fixture.url])), TINY, index=0, eos_token_ids=[]
    )
    try:
        with pytest.raises(EngineError, match="group not initialised"):
            engine.update_weights_from_distributed(["w"], ["float32"], [[1]], version=1)
    finally:
        engine.close()
        fixture.close()
