"""LeakyReLU with a constructor-given negative slope: y = x if x >= 0 else slope * x."""
import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 8192
negative_slope = 0.05

KILN_CPU_SHAPES = {"batch_size": 16, "dim": 4096}
KILN_ALT_SHAPES = [
    {"batch_size": 3, "dim": 1001},
    {"batch_size": 9, "dim": 15, "negative_slope": 0.3},
]


class Model(nn.Module):
    def __init__(self, negative_slope):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x):
        return F.leaky_relu(x, negative_slope=self.negative_slope)


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [negative_slope]
