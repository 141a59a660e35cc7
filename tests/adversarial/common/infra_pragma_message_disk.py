# kiln-adversarial: task=level1/01_relu expect=compile
# An ordinary compile error (an undeclared name) plus a `#pragma message` that prints "No space left on device": any compiler output matching diagnostics._INFRA turns the candidate's own error into infra.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#pragma message("No space left on device")
torch::Tensor relu(torch::Tensor x) {
    return relu_kernel_i_forgot_to_write(x);
}
"""

ext = load_inline(name="kiln_redteam_disk", cpp_sources=src, functions=["relu"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
