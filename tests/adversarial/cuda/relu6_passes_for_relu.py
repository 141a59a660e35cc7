# kiln-adversarial: task=level1/01_relu expect=correctness
# A kernel that saturates at 6 (ReLU6) for a ReLU task: standard-normal inputs never reach 6, so only inputs of a larger magnitude (the large, offset and row-scale input families) tell it from the real thing.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp = "torch::Tensor relu6(torch::Tensor x);"
cuda = r"""
#include <ATen/cuda/CUDAContext.h>

__global__ void relu6_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = fminf(fmaxf(x[i], 0.0f), 6.0f);
}

torch::Tensor relu6(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    const unsigned blocks = (unsigned)((n + 255) / 256 > 4096 ? 4096 : (n + 255) / 256);
    relu6_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

ext = load_inline(name="kiln_adv_relu6_cuda", cpp_sources=cpp, cuda_sources=cuda, functions=["relu6"],
                  extra_cuda_cflags=["-O3"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu6(x)
