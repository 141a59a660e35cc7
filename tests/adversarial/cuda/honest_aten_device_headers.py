# kiln-adversarial: task=level2/06_rmsnorm expect=pass
# Honest: ATen's header-only device helpers compiled into its own kernel (at::native::cuda_utils::BlockReduceSum from block_reduce.cuh, at::opmath_type): its own code, whatever namespace the headers use.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor weight, double eps);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <ATen/OpMathType.h>
#include <ATen/native/cuda/block_reduce.cuh>

template <typename T>
__global__ void rmsnorm_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int64_t hidden, float eps) {
    using acc_t = at::opmath_type<T>;
    __shared__ acc_t shared[32];
    __shared__ acc_t inv;
    const T* row = x + (int64_t)blockIdx.x * hidden;
    T* out = y + (int64_t)blockIdx.x * hidden;
    acc_t acc = 0;
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) acc += static_cast<acc_t>(row[c]) * static_cast<acc_t>(row[c]);
    acc = at::native::cuda_utils::BlockReduceSum<acc_t>(acc, shared);
    if (threadIdx.x == 0) inv = rsqrtf(acc / static_cast<acc_t>(hidden) + eps);
    __syncthreads();
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) out[c] = static_cast<T>(static_cast<acc_t>(row[c]) * inv * static_cast<acc_t>(w[c]));
}

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor weight, double eps) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
    rmsnorm_kernel<float><<<(unsigned)rows, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), weight.contiguous().data_ptr<float>(), y.data_ptr<float>(), hidden, static_cast<float>(eps));
    return y;
}
"""

ext = load_inline(name="kiln_adv_aten_headers", cpp_sources=cpp_source, cuda_sources=cuda_source, functions=["rmsnorm"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        return ext.rmsnorm(x, self.weight, self.eps)
