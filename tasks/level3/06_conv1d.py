"""1-D convolution with bias (an nn.Conv1d named `conv`) with constructor-given kernel size, stride
and zero padding; input (batch, in_channels, length)."""
import torch
import torch.nn as nn

batch_size = 32
in_channels = 64
out_channels = 128
length = 8192
kernel_size = 5
stride = 2
padding = 2

KILN_CPU_SHAPES = {"batch_size": 2, "in_channels": 8, "out_channels": 16, "length": 256}
KILN_ALT_SHAPES = [
    {"batch_size": 3, "in_channels": 5, "out_channels": 7, "length": 101},
    {"batch_size": 2, "in_channels": 3, "out_channels": 6, "length": 40, "kernel_size": 3, "stride": 1, "padding": 0},
]


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=True)

    def forward(self, x):
        return self.conv(x)


def get_inputs():
    return [torch.randn(batch_size, in_channels, length)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding]
