# kiln-adversarial: task=level1/01_relu expect=runtime
# Asks for more GPU memory than exists.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.empty((1 << 44,), device=x.device)
