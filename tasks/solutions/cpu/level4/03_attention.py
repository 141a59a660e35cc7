import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <cmath>
#include <vector>

// softmax(Q K^T / sqrt(D)) V for Q, K, V of shape (batch, S, D); one query row at a time.
torch::Tensor attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-D");
    TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "batch mismatch");
    TORCH_CHECK(k.size(2) == q.size(2) && v.size(1) == k.size(1), "shape mismatch");
    q = q.contiguous();
    k = k.contiguous();
    v = v.contiguous();
    const int64_t B = q.size(0), SQ = q.size(1), D = q.size(2), SK = k.size(1), DV = v.size(2);
    auto out = torch::empty({B, SQ, DV}, q.options());
    const float* pq = q.data_ptr<float>();
    const float* pk = k.data_ptr<float>();
    const float* pv = v.data_ptr<float>();
    float* po = out.data_ptr<float>();
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    std::vector<double> p(SK), acc(DV);
    for (int64_t b = 0; b < B; ++b) {
        const float* kb = pk + b * SK * D;
        const float* vb = pv + b * SK * DV;
        for (int64_t i = 0; i < SQ; ++i) {
            const float* qi = pq + (b * SQ + i) * D;
            double m = -INFINITY;
            for (int64_t j = 0; j < SK; ++j) {
                double s = 0.0;
                for (int64_t d = 0; d < D; ++d) s += static_cast<double>(qi[d]) * kb[j * D + d];
                p[j] = s * scale;
                if (p[j] > m) m = p[j];
            }
            double sum = 0.0;
            for (int64_t j = 0; j < SK; ++j) {
                p[j] = std::exp(p[j] - m);
                sum += p[j];
            }
            for (int64_t d = 0; d < DV; ++d) acc[d] = 0.0;
            for (int64_t j = 0; j < SK; ++j) {
                const double w = p[j] / sum;
                for (int64_t d = 0; d < DV; ++d) acc[d] += w * vb[j * DV + d];
            }
            float* oi = po + (b * SQ + i) * DV;
            for (int64_t d = 0; d < DV; ++d) oi[d] = static_cast<float>(acc[d]);
        }
    }
    return out;
}
"""

attention_ext = load_inline(
    name="kiln_cpu_l4_attention",
    cpp_sources=cpp_source,
    functions=["attention_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        return attention_ext.attention_forward(q, k, v)
