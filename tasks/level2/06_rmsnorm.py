"""RMSNorm over the last dimension with a learned scale: y = x / sqrt(mean(x^2) + eps) * weight,
eps = 1e-6, x of shape (batch, seq, hidden)."""
import torch
import torch.nn as nn

batch_size = 32
seq_len = 512
hidden = 1024

KILN_CPU_SHAPES = {"batch_size": 4, "seq_len": 32, "hidden": 256}
KILN_ALT_SHAPES = [{"batch_size": 3, "seq_len": 5, "hidden": 77}, {"batch_size": 2, "seq_len": 1, "hidden": 1031}]


class Model(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        ms = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(ms + self.eps) * self.weight


def get_inputs():
    return [torch.randn(batch_size, seq_len, hidden)]


def get_init_inputs():
    return [hidden]
