import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <cmath>

// Softmax over the last dimension: subtract the row max, exponentiate, normalise.
torch::Tensor softmax_forward(torch::Tensor x) {
    TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension");
    x = x.contiguous();
    auto out = torch::empty_like(x);
    const int64_t cols = x.size(x.dim() - 1);
    if (x.numel() == 0) return out;
    const int64_t rows = x.numel() / cols;
    const float* src = x.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const float* in = src + r * cols;
        float* o = dst + r * cols;
        float m = in[0];
        for (int64_t c = 1; c < cols; ++c) m = in[c] > m ? in[c] : m;
        double sum = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
            const float e = std::exp(in[c] - m);
            o[c] = e;
            sum += e;
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t c = 0; c < cols; ++c) o[c] *= inv;
    }
    return out;
}
"""

softmax_ext = load_inline(
    name="kiln_cpu_l2_softmax",
    cpp_sources=cpp_source,
    functions=["softmax_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return softmax_ext.softmax_forward(x)
