"""Single-head scaled dot-product attention without mask: softmax(Q K^T / sqrt(head_dim)) V,
Q, K, V of shape (batch, seq_len, head_dim)."""
import math

import torch
import torch.nn as nn

batch_size = 16
seq_len = 1024
head_dim = 64

KILN_CPU_SHAPES = {"batch_size": 2, "seq_len": 64, "head_dim": 32}
KILN_ALT_SHAPES = [{"batch_size": 3, "seq_len": 37, "head_dim": 24}, {"batch_size": 1, "seq_len": 5, "head_dim": 3}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def get_inputs():
    return [
        torch.randn(batch_size, seq_len, head_dim),
        torch.randn(batch_size, seq_len, head_dim),
        torch.randn(batch_size, seq_len, head_dim),
    ]


def get_init_inputs():
    return []
