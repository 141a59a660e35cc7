# kiln-adversarial: task=level1/01_relu expect=cheating
# Torch fallback in Python: forward calls torch.relu.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)
