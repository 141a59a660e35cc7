"""`learner.megatron.fused_norm`'s arithmetic and switch (actors/learner/megatron/norm.py), eager on CPU:
the norm equals the HF model's RMSNorm (what the engines run) and torch's, values and gradients, and
switching keeps every parameter. The compiled kernel is checked against torch's on the GPU
(tests/learner/test_megatron_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from actors.learner.megatron.norm import CompiledRMSNorm, rms_norm, switch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_equals_the_hf_models_values_and_gradients(dtype):
    torch.manual_seed(0)
    hf = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64) * 0.5 + 1)
    x = (torch.randn(37, 1, 64) * 3).to(dtype)
    weight = hf.weight.detach().clone().requires_grad_(True)
    ours_x, theirs_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours, theirs = rms_norm(ours_x, weight, 1e-6), hf(theirs_x)
    assert ours.dtype == dtype and torch.equal(ours, theirs)
    g = torch.randn_like(ours)
    (ours * g).sum().backward()
    (theirs * g).sum().backward()
    # The same ops in the same order: the gradients too, bit for bit.
    assert torch.equal(ours_x.grad, theirs_x.grad) and torch.equal(weight.grad, hf.weight.grad)


def test_the_switch_keeps_every_parameter_and_changes_only_the_forward():
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.RMSNorm(16, eps=1e-5), torch.nn.Linear(16, 16), torch.nn.RMSNorm(16, elementwise_affine=False)
    )
    with torch.no_grad():
        model[0].weight.mul_(torch.rand(16) + 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 16)
    plain = model(x)
    assert switch(model, True, compiled=False) == 1  # the norm without a weight stays torch's
    assert type(model[0]) is CompiledRMSNorm and type(model[2]) is torch.nn.RMSNorm
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    torch.testing.assert_close(model(x), plain, rtol=1e-6, atol=1e-6)
    assert switch(model, False) == 1 and type(model[0]) is torch.nn.RMSNorm
    assert torch.equal(model(x), plain)
