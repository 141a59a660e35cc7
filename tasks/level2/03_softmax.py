"""Softmax over the last dimension of a 2-D tensor (rows of length dim)."""
import torch
import torch.nn as nn

batch_size = 4096
dim = 4096

KILN_CPU_SHAPES = {"batch_size": 32, "dim": 1024}
KILN_ALT_SHAPES = [{"batch_size": 3, "dim": 1001}, {"batch_size": 13, "dim": 7}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.randn(batch_size, dim) * 5.0]


def get_init_inputs():
    return []
