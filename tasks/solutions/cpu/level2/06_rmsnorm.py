import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <cmath>

// RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight.
torch::Tensor rmsnorm_forward(torch::Tensor x, torch::Tensor weight, double eps) {
    const int64_t hidden = x.size(x.dim() - 1);
    TORCH_CHECK(weight.numel() == hidden, "weight must have `hidden` elements");
    x = x.contiguous();
    weight = weight.contiguous();
    auto out = torch::empty_like(x);
    if (x.numel() == 0) return out;
    const int64_t rows = x.numel() / hidden;
    const float* src = x.data_ptr<float>();
    const float* w = weight.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const float* in = src + r * hidden;
        float* o = dst + r * hidden;
        double ss = 0.0;
        for (int64_t c = 0; c < hidden; ++c) ss += static_cast<double>(in[c]) * in[c];
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / hidden + eps));
        for (int64_t c = 0; c < hidden; ++c) o[c] = in[c] * inv * w[c];
    }
    return out;
}
"""

rmsnorm_ext = load_inline(
    name="kiln_cpu_l2_rmsnorm",
    cpp_sources=cpp_source,
    functions=["rmsnorm_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        return rmsnorm_ext.rmsnorm_forward(x, self.weight, self.eps)
