"""Matrix multiplication with a transposed right operand: C = A @ B.T, A of shape (M, K),
B of shape (N, K), C of shape (M, N)."""
import torch
import torch.nn as nn

M = 1024
N = 2048
K = 4096

KILN_CPU_SHAPES = {"M": 128, "N": 96, "K": 160}
KILN_ALT_SHAPES = [{"M": 33, "N": 47, "K": 65}, {"M": 1, "N": 5, "K": 300}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.matmul(A, B.T)


def get_inputs():
    return [torch.randn(M, K), torch.randn(N, K)]


def get_init_inputs():
    return []
