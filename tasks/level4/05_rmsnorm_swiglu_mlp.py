"""LLaMA-style pre-norm gated MLP with residual: n = RMSNorm(x) (eps 1e-6, weight `norm_weight`),
y = x + W_down(silu(W_gate n) * (W_up n)); the three projections are bias-free nn.Linear layers."""
import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 8
seq_len = 256
d_model = 512
hidden = 1536

KILN_CPU_SHAPES = {"batch_size": 2, "seq_len": 16, "d_model": 64, "hidden": 96}
KILN_ALT_SHAPES = [
    {"batch_size": 1, "seq_len": 7, "d_model": 40, "hidden": 56},
    {"batch_size": 3, "seq_len": 1, "d_model": 33, "hidden": 17},
]


class Model(nn.Module):
    def __init__(self, d_model, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(1.0 + 0.1 * torch.randn(d_model))
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        n = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.norm_weight
        return x + self.w_down(F.silu(self.w_gate(n)) * self.w_up(n))


def get_inputs():
    return [torch.randn(batch_size, seq_len, d_model)]


def get_init_inputs():
    return [d_model, hidden]
