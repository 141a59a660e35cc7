"""Max reduction over one dimension of a 3-D tensor (values only, reduced dimension dropped).
The reduced dimension is a constructor argument (default: the last one)."""
import torch
import torch.nn as nn

batch_size = 64
dim1 = 512
dim2 = 1024
reduce_dim = 2

KILN_CPU_SHAPES = {"batch_size": 8, "dim1": 64, "dim2": 256}
KILN_ALT_SHAPES = [
    {"batch_size": 3, "dim1": 37, "dim2": 129},
    {"batch_size": 5, "dim1": 21, "dim2": 33, "reduce_dim": 1},
    {"batch_size": 6, "dim1": 4, "dim2": 9, "reduce_dim": 0},
]


class Model(nn.Module):
    def __init__(self, reduce_dim):
        super().__init__()
        self.reduce_dim = reduce_dim

    def forward(self, x):
        return torch.max(x, dim=self.reduce_dim).values


def get_inputs():
    return [torch.randn(batch_size, dim1, dim2)]


def get_init_inputs():
    return [reduce_dim]
