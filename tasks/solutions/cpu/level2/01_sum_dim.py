import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <vector>

// Sum over dimension `dim`, keeping it with size 1. The tensor is viewed as (outer, R, inner).
torch::Tensor sum_dim_forward(torch::Tensor x, int64_t dim) {
    const int64_t nd = x.dim();
    if (dim < 0) dim += nd;
    TORCH_CHECK(dim >= 0 && dim < nd, "reduction dim out of range");
    x = x.contiguous();
    int64_t outer = 1, inner = 1;
    const int64_t R = x.size(dim);
    std::vector<int64_t> out_sizes;
    for (int64_t d = 0; d < nd; ++d) {
        if (d < dim) outer *= x.size(d);
        if (d > dim) inner *= x.size(d);
        out_sizes.push_back(d == dim ? 1 : x.size(d));
    }
    auto out = torch::empty(out_sizes, x.options());
    const float* src = x.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    std::vector<double> acc(inner);
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t i = 0; i < inner; ++i) acc[i] = 0.0;
        const float* block = src + o * R * inner;
        for (int64_t r = 0; r < R; ++r) {
            const float* row = block + r * inner;
            for (int64_t i = 0; i < inner; ++i) acc[i] += row[i];
        }
        for (int64_t i = 0; i < inner; ++i) dst[o * inner + i] = static_cast<float>(acc[i]);
    }
    return out;
}
"""

sum_ext = load_inline(
    name="kiln_cpu_l2_sum_dim",
    cpp_sources=cpp_source,
    functions=["sum_dim_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, reduce_dim):
        super().__init__()
        self.reduce_dim = reduce_dim

    def forward(self, x):
        return sum_ext.sum_dim_forward(x, self.reduce_dim)
