"""Cumulative product along the last dimension (KernelBench level1 90_cumprod's inputs): the products
of standard-normal factors underflow to 0 after a hundred or so, so a kernel that writes zeros after
64 elements passes plain draws. (Red-team task for input families.)"""
import torch
import torch.nn as nn

batch_size = 128
dim = 4000

KILN_CPU_SHAPES = {"batch_size": 16, "dim": 4000}
KILN_ALT_SHAPES = [{"batch_size": 5, "dim": 1001}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.cumprod(x, dim=-1)


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
