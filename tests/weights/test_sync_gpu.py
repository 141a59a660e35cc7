"""Weight sync on GPUs (run on the GPU machine with `pytest -m gpu`): NCCL from a learner on cuda:0 to
an engine process on cuda:1, and CUDA IPC to an engine process on the learner's own GPU. After each
push the engine's logprobs equal the learner's forward and the engine serves the new version."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.learner.weight_sync import WeightServer
from actors.policy.model import build_model
from configs import ModelConfig
from launch.bench.weight_sync import EngineProcess

pytestmark = pytest.mark.gpu

SMALL = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256, max_seq_len=256)
PROMPT = [256, 72, 101, 108, 108, 111]
RESPONSE = [119, 111, 114, 108, 100, 33, 10]
T = 0.7


def learner_logprobs(model) -> np.ndarray:
    ids = torch.tensor([PROMPT + RESPONSE], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    lp = torch.log_softmax(logits / T, -1).gather(1, torch.tensor(RESPONSE, device=logits.device)[:, None])
    return lp[:, 0].cpu().numpy()


def perturb(model, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))


def push_and_check(tmp_path, transport: str, engine_device: str, bucket_mb: float) -> None:
    learner = build_model(SMALL, "cuda:0")
    server = WeightServer(tmp_path, transport=transport, bucket_mb=bucket_mb, timeout_s=120, join_timeout_s=120)
    endpoints = server.start()
    engine = EngineProcess(endpoints, SMALL, engine_device, "gpu-engine")
    try:
        assert engine.ready_version == 0  # nothing published yet: the initial weights
        version, before = engine.score(PROMPT, RESPONSE, T)
        assert version == 0 and np.abs(np.array(before) - learner_logprobs(learner)).max() < 1e-4
        for v in (1, 2):
            perturb(learner, seed=v)
            report = server.publish(v, learner.named_parameters)
            assert server.wait_confirmed(v, ["gpu-engine"], timeout_s=120), server.health()
            version, after = engine.score(PROMPT, RESPONSE, T)
            assert version == v
            assert np.abs(np.array(after) - learner_logprobs(learner)).max() < 1e-4
            assert np.abs(np.array(after) - np.array(before)).max() > 1e-3
            before = after
        if transport == "nccl":
            assert report.engines == 1 and not report.dropped
    finally:
        engine.stop()
        server.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_push_from_one_gpu_to_an_engine_process_on_another(tmp_path):
    push_and_check(tmp_path, "nccl", "cuda:1", bucket_mb=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_ipc_push_to_an_engine_process_on_the_same_gpu(tmp_path):
    push_and_check(tmp_path, "cuda_ipc", "cuda:0", bucket_mb=0.1)
