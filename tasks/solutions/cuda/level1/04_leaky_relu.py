import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor leaky_relu_forward(torch::Tensor x, double negative_slope);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cstdint>

__device__ __forceinline__ float leaky_op(float v, float slope) { return v > 0.0f ? v : v * slope; }

__global__ void leaky_relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n,
                                  float slope, bool vec) {
    const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t start = 0;
    if (vec) {
        const int64_t n4 = n >> 2;
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float4* y4 = reinterpret_cast<float4*>(y);
        for (int64_t i = tid; i < n4; i += stride) {
            float4 v = x4[i];
            v.x = leaky_op(v.x, slope); v.y = leaky_op(v.y, slope);
            v.z = leaky_op(v.z, slope); v.w = leaky_op(v.w, slope);
            y4[i] = v;
        }
        start = n4 << 2;
    }
    for (int64_t i = start + tid; i < n; i += stride) y[i] = leaky_op(x[i], slope);
}

torch::Tensor leaky_relu_forward(torch::Tensor x, double negative_slope) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    if (n == 0) return y;
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const bool vec = ((reinterpret_cast<uintptr_t>(xp) | reinterpret_cast<uintptr_t>(yp)) & 15) == 0;
    const int threads = 256;
    const int64_t work = vec ? std::max<int64_t>(n >> 2, 1) : n;
    const int blocks = (int)std::min<int64_t>((work + threads - 1) / threads, 65535);
    leaky_relu_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        xp, yp, n, static_cast<float>(negative_slope), vec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

leaky_ext = load_inline(
    name="kiln_cuda_l1_leaky_relu",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["leaky_relu_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, negative_slope):
        super().__init__()
        self.negative_slope = float(negative_slope)

    def forward(self, x):
        return leaky_ext.leaky_relu_forward(x, self.negative_slope)
