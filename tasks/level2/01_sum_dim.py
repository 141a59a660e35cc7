"""Sum reduction over one dimension of a 3-D tensor, keeping the reduced dimension (size 1).
The reduced dimension is a constructor argument (default: the middle one)."""
import torch
import torch.nn as nn

batch_size = 32
dim1 = 1024
dim2 = 1024
reduce_dim = 1

KILN_CPU_SHAPES = {"batch_size": 8, "dim1": 128, "dim2": 128}
KILN_ALT_SHAPES = [
    {"batch_size": 3, "dim1": 37, "dim2": 129},
    {"batch_size": 5, "dim1": 21, "dim2": 33, "reduce_dim": 2},
    {"batch_size": 7, "dim1": 3, "dim2": 10, "reduce_dim": 0},
]


class Model(nn.Module):
    def __init__(self, reduce_dim):
        super().__init__()
        self.reduce_dim = reduce_dim

    def forward(self, x):
        return torch.sum(x, dim=self.reduce_dim, keepdim=True)


def get_inputs():
    return [torch.randn(batch_size, dim1, dim2)]


def get_init_inputs():
    return [reduce_dim]
