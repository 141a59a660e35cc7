"""2-D convolution (no padding, stride 1, nn.Conv2d named `conv`) -> ReLU -> add a learned
per-channel bias `bias` of shape (out_channels, 1, 1)."""
import torch
import torch.nn as nn

batch_size = 16
in_channels = 16
out_channels = 32
height = 128
width = 128
kernel_size = 3

KILN_CPU_SHAPES = {"batch_size": 2, "in_channels": 4, "out_channels": 8, "height": 24, "width": 24}
KILN_ALT_SHAPES = [
    {"batch_size": 3, "in_channels": 3, "out_channels": 5, "height": 11, "width": 17},
    {"batch_size": 2, "in_channels": 2, "out_channels": 4, "height": 9, "width": 12, "kernel_size": 5},
]


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(0.1 * torch.randn(out_channels, 1, 1))

    def forward(self, x):
        return torch.relu(self.conv(x)) + self.bias


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
