# kiln-adversarial: task=level1/01_relu expect=correctness
# forward returns one untouched 1 GiB tensor (no resident memory in the sandbox until the reply copies it once, under the sandbox's memory limit); the verifier reads all of it into memory before seeing the shape is wrong.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.empty(1 << 28, dtype=torch.float32, device=x.device)  # 1 GiB, never written
