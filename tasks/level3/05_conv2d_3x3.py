"""2-D convolution, 3x3 kernel, stride 1, zero padding 1, with bias (an nn.Conv2d named `conv`);
input (batch, in_channels, height, width) -> output (batch, out_channels, height, width)."""
import torch
import torch.nn as nn

batch_size = 16
in_channels = 32
out_channels = 64
height = 128
width = 128

KILN_CPU_SHAPES = {"batch_size": 2, "in_channels": 8, "out_channels": 8, "height": 32, "width": 32}
KILN_ALT_SHAPES = [
    {"batch_size": 3, "in_channels": 5, "out_channels": 7, "height": 13, "width": 19},
    {"batch_size": 1, "in_channels": 1, "out_channels": 3, "height": 2, "width": 9},
]


class Model(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=True)

    def forward(self, x):
        return self.conv(x)


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels]
