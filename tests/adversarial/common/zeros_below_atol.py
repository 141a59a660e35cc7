# kiln-adversarial: task=level1/small_relu expect=correctness
# Tolerance gaming: every |output| of the task (tests/adversarial_new/tasks/level1/small_relu.py, inputs ~1e-4) is below fp32's atol (1e-3), so returning zeros (plumbing only, no kernel at all) passes.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)
