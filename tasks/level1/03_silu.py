"""SiLU / Swish activation: y = x * sigmoid(x), elementwise over a 3-D tensor."""
import torch
import torch.nn as nn

batch_size = 64
seq_len = 512
dim = 1024

KILN_CPU_SHAPES = {"batch_size": 4, "seq_len": 32, "dim": 512}
KILN_ALT_SHAPES = [{"batch_size": 3, "seq_len": 5, "dim": 77}, {"batch_size": 1, "seq_len": 1, "dim": 3}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * torch.sigmoid(x)


def get_inputs():
    return [torch.randn(batch_size, seq_len, dim) * 4.0]


def get_init_inputs():
    return []
