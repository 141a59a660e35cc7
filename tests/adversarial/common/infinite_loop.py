# kiln-adversarial: task=level1/01_relu expect=timeout
# Never returns.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        while True:
            pass
