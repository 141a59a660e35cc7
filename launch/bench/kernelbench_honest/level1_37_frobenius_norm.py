"""Answers KernelBench level1/37_FrobeniusNorm_ (x / ||x||_F over the whole tensor).

Three launches on the caller's stream, no host round trip: a grid-stride pass of per-block sums of
squares (fp32 per thread, fp64 across threads and blocks), a one-block pass that turns them into the
norm on the device, and a grid-stride 16-byte pass that divides every element by it.
"""

from torch import nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor frobenius_forward(torch::Tensor x);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cstdint>

#define PARTIAL_BLOCKS 1024
#define THREADS 512

__device__ __forceinline__ double warp_sum(double v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ double block_sum(double v, double* sh) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    double t = 0.0;
    if (wid == 0) t = warp_sum(lane < nwarps ? sh[lane] : 0.0);
    return t;  // valid in thread 0
}

__global__ void __launch_bounds__(THREADS)
sumsq_kernel(const float* __restrict__ x, int64_t n, bool vec, double* __restrict__ partial) {
    __shared__ double sh[32];
    const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    float a0 = 0.0f, a1 = 0.0f;
    int64_t start = 0;
    if (vec) {
        const int64_t n4 = n >> 2;
        const float4* x4 = reinterpret_cast<const float4*>(x);
        int64_t i = tid;
        for (; i + stride < n4; i += 2 * stride) {
            const float4 v = x4[i], w = x4[i + stride];
            a0 = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, a0))));
            a1 = fmaf(w.x, w.x, fmaf(w.y, w.y, fmaf(w.z, w.z, fmaf(w.w, w.w, a1))));
        }
        for (; i < n4; i += stride) {
            const float4 v = x4[i];
            a0 = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, a0))));
        }
        start = n4 << 2;
    }
    for (int64_t i = start + tid; i < n; i += stride) a0 = fmaf(x[i], x[i], a0);
    const double t = block_sum((double)a0 + (double)a1, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = t;
}

__global__ void norm_kernel(const double* __restrict__ partial, int nparts, float* __restrict__ norm) {
    __shared__ double sh[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += partial[i];
    const double t = block_sum(acc, sh);
    if (threadIdx.x == 0) norm[0] = (float)sqrt(t);
}

__global__ void __launch_bounds__(THREADS)
divide_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n, bool vec, const float* __restrict__ norm) {
    const float d = *norm;
    const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t start = 0;
    if (vec) {
        const int64_t n4 = n >> 2;
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float4* y4 = reinterpret_cast<float4*>(y);
        for (int64_t i = tid; i < n4; i += stride) {
            float4 v = __ldcs(x4 + i);
            v.x = v.x / d; v.y = v.y / d; v.z = v.z / d; v.w = v.w / d;
            __stcs(y4 + i, v);
        }
        start = n4 << 2;
    }
    for (int64_t i = start + tid; i < n; i += stride) y[i] = x[i] / d;
}

torch::Tensor frobenius_forward(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "float32 only");
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    if (n == 0) return y;
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const bool vec = ((reinterpret_cast<uintptr_t>(xp) | reinterpret_cast<uintptr_t>(yp)) & 15) == 0;
    auto partial = torch::empty({PARTIAL_BLOCKS}, x.options().dtype(torch::kDouble));
    auto norm = torch::empty({1}, x.options());
    auto stream = at::cuda::getCurrentCUDAStream();
    const int64_t work = vec ? std::max<int64_t>(n >> 2, 1) : n;
    const int blocks = (int)std::min<int64_t>((work + THREADS - 1) / THREADS, PARTIAL_BLOCKS);
    sumsq_kernel<<<blocks, THREADS, 0, stream>>>(xp, n, vec, partial.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    norm_kernel<<<1, 1024, 0, stream>>>(partial.data_ptr<double>(), blocks, norm.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device());
    const int dblocks = (int)std::min<int64_t>((work + THREADS - 1) / THREADS, (int64_t)std::max(sms, 1) * 16);
    divide_kernel<<<dblocks, THREADS, 0, stream>>>(xp, yp, n, vec, norm.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

frobenius_ext = load_inline(
    name="kiln_kb_honest_l1_37_frobenius_norm",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["frobenius_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return frobenius_ext.frobenius_forward(x)
