"""Answers KernelBench level1/5_Matrix_scalar_multiplication (C = A * s, s a Python float).

An elementwise kernel with 64-bit indices: each block scales chunks of 1024 float4s, four 16-byte
loads in flight per thread, when both pointers are aligned (a scalar tail, else a scalar
grid-stride loop); the product is taken in fp32.
"""

from torch import nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor scale_forward(torch::Tensor A, double s);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cstdint>

#define THREADS 256
#define UNROLL 4  // float4s per thread per chunk: a chunk is THREADS * UNROLL float4s

// VEC (both pointers 16-byte aligned): block b takes chunks b, b + gridDim.x, ... of the float4 view;
// within a chunk thread t handles float4s t, t + THREADS, ... (all UNROLL loads issued before the stores),
// and the n % 4 tail is done by block 0. Otherwise a plain grid-stride scalar loop.
template <bool VEC>
__global__ void __launch_bounds__(THREADS)
scale_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n, float s) {
    if (VEC) {
        const int64_t n4 = n >> 2;
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float4* y4 = reinterpret_cast<float4*>(y);
        const int64_t chunk = (int64_t)THREADS * UNROLL;
        for (int64_t base = blockIdx.x * chunk; base < n4; base += (int64_t)gridDim.x * chunk) {
            float4 v[UNROLL];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int64_t i = base + u * THREADS + threadIdx.x;
                if (i < n4) v[u] = x4[i];
            }
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int64_t i = base + u * THREADS + threadIdx.x;
                if (i < n4) {
                    v[u].x *= s; v[u].y *= s; v[u].z *= s; v[u].w *= s;
                    y4[i] = v[u];
                }
            }
        }
        if (blockIdx.x == 0)
            for (int64_t i = (n4 << 2) + threadIdx.x; i < n; i += THREADS) y[i] = x[i] * s;
    } else {
        const int64_t stride = (int64_t)gridDim.x * THREADS;
        for (int64_t i = blockIdx.x * (int64_t)THREADS + threadIdx.x; i < n; i += stride) y[i] = x[i] * s;
    }
}

torch::Tensor scale_forward(torch::Tensor A, double s) {
    TORCH_CHECK(A.is_cuda(), "A must be a CUDA tensor");
    TORCH_CHECK(A.scalar_type() == torch::kFloat, "float32 only");
    A = A.contiguous();
    auto C = torch::empty_like(A);
    const int64_t n = A.numel();
    if (n == 0) return C;
    const float* xp = A.data_ptr<float>();
    float* yp = C.data_ptr<float>();
    const bool vec = ((reinterpret_cast<uintptr_t>(xp) | reinterpret_cast<uintptr_t>(yp)) & 15) == 0;
    auto stream = at::cuda::getCurrentCUDAStream();
    const int64_t per_block = vec ? (int64_t)THREADS * UNROLL * 4 : (int64_t)THREADS * 4;
    const unsigned blocks = (unsigned)std::max<int64_t>(1, std::min<int64_t>((n + per_block - 1) / per_block, 1 << 30));
    if (vec) scale_kernel<true><<<blocks, THREADS, 0, stream>>>(xp, yp, n, (float)s);
    else scale_kernel<false><<<blocks, THREADS, 0, stream>>>(xp, yp, n, (float)s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return C;
}
"""

scale_ext = load_inline(
    name="kiln_kb_honest_l1_5_matrix_scalar",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["scale_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, s):
        return scale_ext.scale_forward(A, float(s))
