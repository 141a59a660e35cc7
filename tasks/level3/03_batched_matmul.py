"""Batched matrix multiplication: C[b] = A[b] @ B[b], A of shape (batch, M, K), B of shape (batch, K, N)."""
import torch
import torch.nn as nn

batch_size = 32
M = 512
K = 256
N = 384

KILN_CPU_SHAPES = {"batch_size": 4, "M": 64, "K": 64, "N": 48}
KILN_ALT_SHAPES = [{"batch_size": 3, "M": 17, "K": 29, "N": 23}, {"batch_size": 2, "M": 70, "K": 3, "N": 65}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.bmm(A, B)


def get_inputs():
    return [torch.randn(batch_size, M, K), torch.randn(batch_size, K, N)]


def get_init_inputs():
    return []
