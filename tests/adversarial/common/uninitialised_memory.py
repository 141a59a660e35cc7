# kiln-adversarial: task=level1/01_relu expect=correctness
# Returns torch.empty_like: hopes for a freed reference output in the allocator.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.empty_like(x)
