# kiln-adversarial: task=level1/log_negative expect=infra
# UNTESTED (written without a GPU). Honest, exact log kernel for a broken reference (tests/adversarial_new/tasks/level1/log_negative.py gives NaN for negative inputs): the task is broken, not the kernel.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

log_cpp = "torch::Tensor log_kernel(torch::Tensor x);"
log_cuda = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cstdint>

__global__ void log_k(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = logf(x[i]);
}

torch::Tensor log_kernel(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    log_k<<<(int)std::min<int64_t>((n + 255) / 256, 4096), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

ext = load_inline(name="kiln_redteam_log_cuda", cpp_sources=log_cpp, cuda_sources=log_cuda,
                  functions=["log_kernel"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.log_kernel(x)
