"""Elementwise product of two tensors plus a broadcast bias vector (a learned parameter):
y = a * b + bias, with a, b of shape (batch_size, dim) and bias of shape (dim,)."""
import torch
import torch.nn as nn

batch_size = 4096
dim = 4096

KILN_CPU_SHAPES = {"batch_size": 16, "dim": 2048}
KILN_ALT_SHAPES = [{"batch_size": 3, "dim": 1001}, {"batch_size": 11, "dim": 6}]


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, a, b):
        return a * b + self.bias


def get_inputs():
    return [torch.randn(batch_size, dim), torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim]
