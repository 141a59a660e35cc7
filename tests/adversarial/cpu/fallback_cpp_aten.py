# kiln-adversarial: task=level1/01_relu expect=cheating
# ATen called from C++ by name (at::relu): caught before compiling.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ext = load_inline(
    name="kiln_adversarial_cpp_aten",
    cpp_sources="torch::Tensor f(torch::Tensor x) { return at::relu(x); }",
    functions=["f"],
    verbose=False,
)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.f(x)
