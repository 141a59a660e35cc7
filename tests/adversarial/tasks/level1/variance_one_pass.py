"""Variance of each row, written as E[x^2] - E[x]^2 in float32: the reference itself cancels once the
rows' mean is large against their spread, so at a large offset an exact kernel is off the reference
by the reference's own error. (Task for the offset family's float64 allowance.)"""
import torch
import torch.nn as nn

batch_size = 4096
dim = 4096

KILN_CPU_SHAPES = {"batch_size": 32, "dim": 256}
KILN_ALT_SHAPES = [{"batch_size": 5, "dim": 77}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return (x * x).mean(dim=-1) - x.mean(dim=-1) ** 2


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
