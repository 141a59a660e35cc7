# kiln-adversarial: task=level1/01_relu expect=cheating
# Torch fallback through a tensor method (x.clamp).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x.clamp(min=0)
