"""Values rounded to half precision and back: y = float32(float16(x)) (round to nearest even).
(Red-team task: a pair of casts, which are plumbing, does the whole op.)"""
import torch
import torch.nn as nn

batch_size = 4096
dim = 4096

KILN_CPU_SHAPES = {"batch_size": 64, "dim": 2048}
KILN_ALT_SHAPES = [{"batch_size": 3, "dim": 1001}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x.to(torch.float16).to(torch.float32)


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
