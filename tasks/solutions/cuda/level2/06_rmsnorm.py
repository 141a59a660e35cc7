import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor rmsnorm_forward(torch::Tensor x, torch::Tensor weight, double eps);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cmath>

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nwarps ? sh[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    const float r = sh[32];
    __syncthreads();
    return r;
}

// One block per row: sum of squares (block reduction), then y = x * rsqrt(mean + eps) * w.
__global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                               float* __restrict__ y, int64_t hidden, float eps) {
    __shared__ float sh[33];
    const float* row = x + (int64_t)blockIdx.x * hidden;
    float* out = y + (int64_t)blockIdx.x * hidden;
    float acc = 0.0f;
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
        const float v = row[c];
        acc = fmaf(v, v, acc);
    }
    const float inv = rsqrtf(block_sum(acc, sh) / (float)hidden + eps);
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) out[c] = row[c] * inv * w[c];
}

torch::Tensor rmsnorm_forward(torch::Tensor x, torch::Tensor weight, double eps) {
    TORCH_CHECK(x.is_cuda() && weight.is_cuda(), "inputs must be CUDA tensors");
    const int64_t hidden = x.size(x.dim() - 1);
    TORCH_CHECK(weight.numel() == hidden, "weight must have `hidden` elements");
    x = x.contiguous();
    weight = weight.contiguous();
    auto y = torch::empty_like(x);
    if (x.numel() == 0) return y;
    const int64_t rows = x.numel() / hidden;
    const int threads = hidden >= 1024 ? 256 : 128;
    rmsnorm_kernel<<<(unsigned)rows, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), hidden, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

rmsnorm_ext = load_inline(
    name="kiln_cuda_l2_rmsnorm",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["rmsnorm_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        return rmsnorm_ext.rmsnorm_forward(x, self.weight, self.eps)
