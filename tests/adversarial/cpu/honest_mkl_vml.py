# kiln-adversarial: task=level1/03_silu expect=pass
# Honest vendor math, allowed by default: x * sigmoid(x) with the exponential from MKL's vector math library (VML's vsExp, bundled in torch's own library), the rest in the kernel.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
#include <vector>
extern "C" void vsExp(const int n, const float* a, float* r);

torch::Tensor silu(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    const int64_t n = x.numel();
    std::vector<float> neg(n), e(n);
    for (int64_t i = 0; i < n; ++i) neg[i] = -s[i];
    vsExp(static_cast<int>(n), neg.data(), e.data());
    for (int64_t i = 0; i < n; ++i) d[i] = s[i] / (1.0f + e[i]);
    return y;
}
"""

ext = load_inline(name="kiln_adv_vml", cpp_sources=source, functions=["silu"], verbose=False, extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.silu(x)
