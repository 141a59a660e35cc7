"""ReLU activation: y = max(x, 0), elementwise over a 2-D float32 tensor."""
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
        return torch.relu(x)


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
