"""Linear layer followed by exact (erf) GELU: y = gelu(x @ W^T + b), with the nn.Linear named `fc`."""
import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 1024
in_features = 2048
out_features = 2048

KILN_CPU_SHAPES = {"batch_size": 32, "in_features": 128, "out_features": 64}
KILN_ALT_SHAPES = [{"batch_size": 5, "in_features": 67, "out_features": 31}, {"batch_size": 2, "in_features": 130, "out_features": 3}]


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return F.gelu(self.fc(x))


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
