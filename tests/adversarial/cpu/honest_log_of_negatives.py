# kiln-adversarial: task=level1/log_negative expect=infra
# Honest, exact log kernel for a broken reference (tests/adversarial_new/tasks/level1/log_negative.py: log of N(0,1) inputs gives NaN for every negative input); the task is broken, not the kernel: infra for the task, not -1.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

log_source = r"""
#include <cmath>
#include <cstdint>

torch::Tensor log_kernel(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) d[i] = std::log(s[i]);
    return y;
}
"""

ext = load_inline(name="kiln_redteam_log", cpp_sources=log_source, functions=["log_kernel"], verbose=False,
                  extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.log_kernel(x)
