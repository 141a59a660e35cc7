# kiln-adversarial: task=level1/01_relu expect=pass
# Honest: a ReLU written with at::vec::Vectorized<float> (header-only SIMD types from ATen/cpu/vec, AVX2 selected with -mavx2 -mfma -DCPU_CAPABILITY_AVX2), no ATen operator anywhere.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

vec_source = r"""
#include <ATen/cpu/vec/vec.h>
#include <cstdint>

torch::Tensor relu(torch::Tensor x) {
    using Vec = at::vec::Vectorized<float>;
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    const int64_t n = x.numel();
    const Vec zero(0.0f);
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size())
        at::vec::maximum(Vec::loadu(s + i), zero).store(d + i);
    if (i < n) at::vec::maximum(Vec::loadu(s + i, n - i), zero).store(d + i, n - i);
    return y;
}
"""

ext = load_inline(name="kiln_redteam_at_vec", cpp_sources=vec_source, functions=["relu"], verbose=False,
                  extra_cflags=["-O3", "-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
