"""Pairs of real numbers packed into complex numbers: y[b, j] = x[b, 2j] + i x[b, 2j+1] (complex64).
(Red-team task: an output of a dtype the verifier once could not carry.)"""
import torch
import torch.nn as nn

batch_size = 1024
dim = 4096

KILN_CPU_SHAPES = {"batch_size": 32, "dim": 512}
KILN_ALT_SHAPES = [{"batch_size": 3, "dim": 34}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.complex(x[:, 0::2], x[:, 1::2])


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
