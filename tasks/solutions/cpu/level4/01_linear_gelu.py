import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <cmath>

// y = gelu(x @ W^T + b) with the exact erf GELU.
torch::Tensor linear_gelu_forward(torch::Tensor x, torch::Tensor weight, torch::Tensor bias) {
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x and weight must be 2-D");
    TORCH_CHECK(x.size(1) == weight.size(1), "in_features mismatch");
    TORCH_CHECK(bias.numel() == weight.size(0), "bias size mismatch");
    x = x.contiguous();
    weight = weight.contiguous();
    bias = bias.contiguous();
    const int64_t B = x.size(0), IN = x.size(1), OUT = weight.size(0);
    auto y = torch::empty({B, OUT}, x.options());
    const float* px = x.data_ptr<float>();
    const float* pw = weight.data_ptr<float>();
    const float* pb = bias.data_ptr<float>();
    float* py = y.data_ptr<float>();
    const double inv_sqrt2 = 0.7071067811865476;
    for (int64_t i = 0; i < B; ++i) {
        const float* xr = px + i * IN;
        for (int64_t o = 0; o < OUT; ++o) {
            const float* wr = pw + o * IN;
            double acc = pb[o];
            for (int64_t k = 0; k < IN; ++k) acc += static_cast<double>(xr[k]) * wr[k];
            py[i * OUT + o] = static_cast<float>(0.5 * acc * (1.0 + std::erf(acc * inv_sqrt2)));
        }
    }
    return y;
}
"""

linear_gelu_ext = load_inline(
    name="kiln_cpu_l4_linear_gelu",
    cpp_sources=cpp_source,
    functions=["linear_gelu_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return linear_gelu_ext.linear_gelu_forward(x, self.fc.weight, self.fc.bias)
