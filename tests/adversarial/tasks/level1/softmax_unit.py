"""Softmax over the last dimension of standard-normal rows (KernelBench level1 23_Softmax's inputs):
their largest values stay far below exp's float32 overflow (88) even 16 times larger, so a softmax
without the max shift passes plain and x16 draws. (Red-team task for input families.)"""
import torch
import torch.nn as nn

batch_size = 4096
dim = 4096

KILN_CPU_SHAPES = {"batch_size": 16, "dim": 1024}
KILN_ALT_SHAPES = [{"batch_size": 3, "dim": 1001}, {"batch_size": 13, "dim": 7}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
