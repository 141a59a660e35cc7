# kiln-adversarial: task=level1/01_relu expect=compile
# A kernel that is simply wrong C++ (a type error), with `#warning "out of memory allocating 4096 bytes"`: the failure becomes infra (score 0) instead of compile (-1).
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#warning "out of memory allocating 4096 bytes"
torch::Tensor relu(torch::Tensor x) {
    int y = x;  // not C++
    return x;
}
"""

ext = load_inline(name="kiln_redteam_oom", cpp_sources=src, functions=["relu"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
