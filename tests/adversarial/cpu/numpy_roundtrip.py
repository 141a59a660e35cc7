# kiln-adversarial: task=level1/01_relu expect=cheating
# Host round-trip: computes with numpy (reached without naming numpy).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        arr = getattr(x, "nu" + "mpy")()
        out = torch.empty_like(x)
        out.copy_(torch.as_tensor((arr > 0) * arr))
        return out
