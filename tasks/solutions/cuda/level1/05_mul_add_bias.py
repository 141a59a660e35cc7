import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor mul_add_bias_forward(torch::Tensor a, torch::Tensor b, torch::Tensor bias);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cstdint>

// y[r, c] = a[r, c] * b[r, c] + bias[c] over a (rows x cols) row-major tensor.
// Vector path (float4) when cols % 4 == 0 and every pointer is 16-byte aligned: then a float4
// never straddles two rows and the matching bias chunk is bias4[(i % (cols / 4))].
__global__ void mul_add_bias_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                    const float* __restrict__ bias, float* __restrict__ y,
                                    int64_t n, int64_t cols, bool vec) {
    const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if (vec) {
        const int64_t n4 = n >> 2, cols4 = cols >> 2;
        const float4* a4 = reinterpret_cast<const float4*>(a);
        const float4* b4 = reinterpret_cast<const float4*>(b);
        const float4* bias4 = reinterpret_cast<const float4*>(bias);
        float4* y4 = reinterpret_cast<float4*>(y);
        for (int64_t i = tid; i < n4; i += stride) {
            const float4 va = a4[i], vb = b4[i], vc = bias4[i % cols4];
            float4 r;
            r.x = fmaf(va.x, vb.x, vc.x); r.y = fmaf(va.y, vb.y, vc.y);
            r.z = fmaf(va.z, vb.z, vc.z); r.w = fmaf(va.w, vb.w, vc.w);
            y4[i] = r;
        }
    } else {
        for (int64_t i = tid; i < n; i += stride) y[i] = fmaf(a[i], b[i], bias[i % cols]);
    }
}

torch::Tensor mul_add_bias_forward(torch::Tensor a, torch::Tensor b, torch::Tensor bias) {
    TORCH_CHECK(a.is_cuda() && b.is_cuda() && bias.is_cuda(), "inputs must be CUDA tensors");
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "a and b must be 2-D");
    TORCH_CHECK(a.size(0) == b.size(0) && a.size(1) == b.size(1), "a and b must have the same shape");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == a.size(1), "bias must have shape (dim,)");
    a = a.contiguous();
    b = b.contiguous();
    bias = bias.contiguous();
    auto y = torch::empty_like(a);
    const int64_t n = a.numel();
    const int64_t cols = a.size(1);
    if (n == 0) return y;
    const float* pa = a.data_ptr<float>();
    const float* pb = b.data_ptr<float>();
    const float* pbias = bias.data_ptr<float>();
    float* py = y.data_ptr<float>();
    const uintptr_t addr_bits = reinterpret_cast<uintptr_t>(pa) | reinterpret_cast<uintptr_t>(pb) |
                                reinterpret_cast<uintptr_t>(pbias) | reinterpret_cast<uintptr_t>(py);
    const bool vec = (cols % 4 == 0) && ((addr_bits & 15) == 0);
    const int threads = 256;
    const int64_t work = vec ? (n >> 2) : n;
    const int blocks = (int)std::min<int64_t>((work + threads - 1) / threads, 65535);
    mul_add_bias_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(pa, pb, pbias, py, n, cols, vec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

mab_ext = load_inline(
    name="kiln_cuda_l1_mul_add_bias",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["mul_add_bias_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, a, b):
        return mab_ext.mul_add_bias_forward(a, b, self.bias)
