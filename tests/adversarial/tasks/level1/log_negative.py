"""Natural logarithm, y = log(x), of inputs that include negatives: the reference itself returns NaN
for every x < 0 from finite inputs (a broken task; red-team case for class 10d)."""
import torch
import torch.nn as nn

batch_size = 4096
dim = 8192

KILN_CPU_SHAPES = {"batch_size": 16, "dim": 4096}
KILN_ALT_SHAPES = [{"batch_size": 3, "dim": 1001}, {"batch_size": 7, "dim": 33}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.log(x)


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
