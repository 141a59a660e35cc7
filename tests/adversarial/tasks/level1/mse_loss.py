"""Mean squared error of two standard-normal tensors (KernelBench level1 94_MSELoss's inputs): at 2^23
elements the loss is E[(p - t)^2] = 2 within a quarter of fp32's tolerance bound, so the constant 2
passes plain draws. (Red-team task for input families and the sensitivity trial.)"""
import torch
import torch.nn as nn

batch_size = 8192
dim = 1024

KILN_CPU_SHAPES = {"batch_size": 8192, "dim": 1024}
KILN_ALT_SHAPES = [{"batch_size": 4096, "dim": 2048}]


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, predictions, targets):
        return torch.mean((predictions - targets) ** 2)


def get_inputs():
    return [torch.randn(batch_size, dim), torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
