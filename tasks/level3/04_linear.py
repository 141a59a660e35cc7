"""Fully connected layer: y = x @ W^T + b (an nn.Linear named `fc`), x of shape (batch, in_features)."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 2048
out_features = 2048

KILN_CPU_SHAPES = {"batch_size": 32, "in_features": 128, "out_features": 64}
KILN_ALT_SHAPES = [{"batch_size": 5, "in_features": 67, "out_features": 31}, {"batch_size": 1, "in_features": 3, "out_features": 130}]


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.fc(x)


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
