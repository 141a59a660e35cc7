import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <cmath>

// LayerNorm over the last dimension (two-pass mean / biased variance in double).
torch::Tensor layernorm_forward(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps) {
    const int64_t hidden = x.size(x.dim() - 1);
    TORCH_CHECK(weight.numel() == hidden && bias.numel() == hidden, "weight/bias must have `hidden` elements");
    x = x.contiguous();
    weight = weight.contiguous();
    bias = bias.contiguous();
    auto out = torch::empty_like(x);
    if (x.numel() == 0) return out;
    const int64_t rows = x.numel() / hidden;
    const float* src = x.data_ptr<float>();
    const float* w = weight.data_ptr<float>();
    const float* b = bias.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const float* in = src + r * hidden;
        float* o = dst + r * hidden;
        double mean = 0.0;
        for (int64_t c = 0; c < hidden; ++c) mean += in[c];
        mean /= static_cast<double>(hidden);
        double var = 0.0;
        for (int64_t c = 0; c < hidden; ++c) {
            const double d = in[c] - mean;
            var += d * d;
        }
        var /= static_cast<double>(hidden);
        const double rstd = 1.0 / std::sqrt(var + eps);
        for (int64_t c = 0; c < hidden; ++c) {
            o[c] = static_cast<float>((in[c] - mean) * rstd) * w[c] + b[c];
        }
    }
    return out;
}
"""

layernorm_ext = load_inline(
    name="kiln_cpu_l2_layernorm",
    cpp_sources=cpp_source,
    functions=["layernorm_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        # Same parameter names, shapes and initialisation as the reference (ln.weight, ln.bias).
        self.ln = nn.LayerNorm(hidden, eps=1e-5)
        with torch.no_grad():
            self.ln.weight.add_(0.1 * torch.randn(hidden))
            self.ln.bias.add_(0.1 * torch.randn(hidden))

    def forward(self, x):
        return layernorm_ext.layernorm_forward(x, self.ln.weight, self.ln.bias, self.ln.eps)
