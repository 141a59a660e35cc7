# kiln-adversarial: task=level1/01_relu expect=pass
# Honest: an OpenMP ReLU whose team starts only from the second call (`#pragma omp parallel for if(...)`: the first call is serial, as a warm-up); the team's threads then look "new after forward" to the thread check.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

omp_source = r"""
#include <omp.h>
#include <cstdint>

static int64_t calls = 0;

torch::Tensor relu(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    const int64_t n = x.numel();
    const bool parallel = calls++ > 0 && n >= 4096;
    #pragma omp parallel for if(parallel) num_threads(2) schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] = s[i] > 0.0f ? s[i] : 0.0f;
    return y;
}
"""

ext = load_inline(name="kiln_redteam_omp_late", cpp_sources=omp_source, functions=["relu"], verbose=False,
                  extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x)
