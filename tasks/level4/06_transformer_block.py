"""Pre-norm GPT-style transformer block: x + Attn(LN1(x)) with causal multi-head self-attention, then
x + MLP(LN2(x)) with an exact-GELU MLP of width mlp_ratio * d_model (nn.Linear / nn.LayerNorm params)."""
import math

import torch
import torch.nn as nn

batch_size = 8
seq_len = 256
d_model = 256
n_heads = 4
mlp_ratio = 4

KILN_CPU_SHAPES = {"batch_size": 2, "seq_len": 16, "d_model": 32, "n_heads": 2}
KILN_ALT_SHAPES = [
    {"batch_size": 1, "seq_len": 13, "d_model": 48, "n_heads": 3},
    {"batch_size": 2, "seq_len": 5, "d_model": 20, "n_heads": 2, "mlp_ratio": 3},
]


class Model(nn.Module):
    def __init__(self, d_model, n_heads, mlp_ratio):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)
        self.act = nn.GELU()
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.add_(0.1 * torch.randn(d_model))
                ln.bias.add_(0.1 * torch.randn(d_model))

    def forward(self, x):
        B, T, C = x.shape
        H = self.n_heads
        Dh = C // H
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q = q.reshape(B, T, H, Dh).transpose(1, 2)
        k = k.reshape(B, T, H, Dh).transpose(1, 2)
        v = v.reshape(B, T, H, Dh).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(Dh))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


def get_inputs():
    return [torch.randn(batch_size, seq_len, d_model)]


def get_init_inputs():
    return [d_model, n_heads, mlp_ratio]
