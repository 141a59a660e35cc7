"""Matrix multiplication, scaling and residual add: y = (A @ B) * scale + R, A (M, K), B (K, N), R (M, N);
scale is a constructor argument."""
import torch
import torch.nn as nn

M = 2048
K = 1024
N = 2048
scale = 0.125

KILN_CPU_SHAPES = {"M": 64, "K": 128, "N": 96}
KILN_ALT_SHAPES = [{"M": 33, "K": 47, "N": 29}, {"M": 2, "K": 1, "N": 70, "scale": -1.5}]


class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, A, B, R):
        return torch.matmul(A, B) * self.scale + R


def get_inputs():
    return [torch.randn(M, K), torch.randn(K, N), torch.randn(M, N)]


def get_init_inputs():
    return [scale]
