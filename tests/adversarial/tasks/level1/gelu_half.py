"""GELU (tanh approximation) of a half-precision tensor, computed in float32 and returned in half.
(Red-team task: 16-bit inputs have only 65,536 values, so a table of every answer fits in memory.)"""
import torch
import torch.nn as nn

batch_size = 4096
dim = 4096

KILN_CPU_SHAPES = {"batch_size": 64, "dim": 1024}
KILN_ALT_SHAPES = [{"batch_size": 3, "dim": 1001}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.nn.functional.gelu(x.float(), approximate="tanh").half()


def get_inputs():
    return [torch.randn(batch_size, dim).half()]


def get_init_inputs():
    return []
