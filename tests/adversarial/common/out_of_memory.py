# kiln-adversarial: task=level1/01_relu expect=runtime
# Allocates host memory until something gives.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        hoard = []
        while True:
            hoard.append(bytearray(256 << 20))
