import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <cmath>
#include <vector>

// Per token: n = x / sqrt(mean(x^2) + eps) * g; a = silu(Wg n) * (Wu n); y = x + Wd a.
torch::Tensor swiglu_mlp_forward(torch::Tensor x, torch::Tensor norm_weight, torch::Tensor w_gate,
                                 torch::Tensor w_up, torch::Tensor w_down, double eps) {
    const int64_t D = x.size(x.dim() - 1);
    const int64_t Hd = w_gate.size(0);
    TORCH_CHECK(norm_weight.numel() == D, "norm_weight size mismatch");
    TORCH_CHECK(w_gate.size(1) == D && w_up.size(0) == Hd && w_up.size(1) == D, "gate/up shape mismatch");
    TORCH_CHECK(w_down.size(0) == D && w_down.size(1) == Hd, "down shape mismatch");
    x = x.contiguous();
    norm_weight = norm_weight.contiguous();
    w_gate = w_gate.contiguous();
    w_up = w_up.contiguous();
    w_down = w_down.contiguous();
    auto y = torch::empty_like(x);
    if (x.numel() == 0) return y;
    const int64_t T = x.numel() / D;
    const float* px = x.data_ptr<float>();
    const float* pg = norm_weight.data_ptr<float>();
    const float* wg = w_gate.data_ptr<float>();
    const float* wu = w_up.data_ptr<float>();
    const float* wd = w_down.data_ptr<float>();
    float* py = y.data_ptr<float>();
    std::vector<float> n(D), a(Hd);
    for (int64_t t = 0; t < T; ++t) {
        const float* xt = px + t * D;
        double ss = 0.0;
        for (int64_t j = 0; j < D; ++j) ss += static_cast<double>(xt[j]) * xt[j];
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / D + eps));
        for (int64_t j = 0; j < D; ++j) n[j] = xt[j] * inv * pg[j];
        for (int64_t h = 0; h < Hd; ++h) {
            double g = 0.0, u = 0.0;
            for (int64_t j = 0; j < D; ++j) {
                g += static_cast<double>(wg[h * D + j]) * n[j];
                u += static_cast<double>(wu[h * D + j]) * n[j];
            }
            a[h] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
        }
        float* yt = py + t * D;
        for (int64_t j = 0; j < D; ++j) {
            double acc = 0.0;
            for (int64_t h = 0; h < Hd; ++h) acc += static_cast<double>(wd[j * Hd + h]) * a[h];
            yt[j] = xt[j] + static_cast<float>(acc);
        }
    }
    return y;
}
"""

mlp_ext = load_inline(
    name="kiln_cpu_l4_rmsnorm_swiglu_mlp",
    cpp_sources=cpp_source,
    functions=["swiglu_mlp_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, d_model, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(1.0 + 0.1 * torch.randn(d_model))
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return mlp_ext.swiglu_mlp_forward(
            x, self.norm_weight, self.w_gate.weight, self.w_up.weight, self.w_down.weight, self.eps
        )
