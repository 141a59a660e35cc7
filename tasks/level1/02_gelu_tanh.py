"""GELU with the tanh approximation (F.gelu(x, approximate="tanh")), elementwise over a 2-D tensor.
y = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 8192

KILN_CPU_SHAPES = {"batch_size": 16, "dim": 4096}
KILN_ALT_SHAPES = [{"batch_size": 3, "dim": 1001}, {"batch_size": 5, "dim": 62}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return F.gelu(x, approximate="tanh")


def get_inputs():
    return [torch.randn(batch_size, dim) * 3.0]


def get_init_inputs():
    return []
