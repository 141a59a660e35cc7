"""Square matrix multiplication: C = A @ B with A, B of shape (N, N)."""
import torch
import torch.nn as nn

N = 2048

KILN_CPU_SHAPES = {"N": 128}
KILN_ALT_SHAPES = [{"N": 97}, {"N": 33}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.matmul(A, B)


def get_inputs():
    return [torch.randn(N, N), torch.randn(N, N)]


def get_init_inputs():
    return []
