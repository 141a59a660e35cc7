"""HardTanh: clamp every element into [min_val, max_val] (constructor arguments)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 8192
min_val = -0.75
max_val = 1.25

KILN_CPU_SHAPES = {"batch_size": 16, "dim": 4096}
KILN_ALT_SHAPES = [
    {"batch_size": 3, "dim": 1001},
    {"batch_size": 2, "dim": 45, "min_val": -2.0, "max_val": 0.5},
]


class Model(nn.Module):
    def __init__(self, min_val, max_val):
        super().__init__()
        self.min_val = min_val
        self.max_val = max_val

    def forward(self, x):
        return F.hardtanh(x, min_val=self.min_val, max_val=self.max_val)


def get_inputs():
    return [torch.randn(batch_size, dim) * 2.0]


def get_init_inputs():
    return [min_val, max_val]
