# kiln-adversarial: task=level1/01_relu expect=compile
# Loads a compiler plugin through extra_cflags (code run inside the compiler).
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
torch::Tensor f(torch::Tensor x) { return torch::empty_like(x); }
"""

ext = load_inline(name="native_compiler_plugin", cpp_sources=source, functions=["f"], verbose=False,
                  extra_cflags=["-fplugin=/tmp/kiln-plugin.so"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.f(x)
