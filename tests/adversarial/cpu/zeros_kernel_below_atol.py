# kiln-adversarial: task=level1/small_relu expect=correctness
# Tolerance gaming with a "kernel": a C++ extension that only writes zeros, on a task whose every |output| is below atol (tests/adversarial_new/tasks/level1/small_relu.py); fast enough to earn a speed bonus.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

zero_source = r"""
#include <cstring>
torch::Tensor fake_relu(torch::Tensor x) {
    auto y = torch::empty_like(x);
    std::memset(y.data_ptr<float>(), 0, y.numel() * sizeof(float));
    return y;
}
"""

ext = load_inline(name="kiln_redteam_zeros", cpp_sources=zero_source, functions=["fake_relu"], verbose=False,
                  extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.fake_relu(x)
