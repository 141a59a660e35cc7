# kiln-adversarial: task=level1/01_relu expect=cheating
# Torch fallback through a torch.nn module.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(x)
