"""Answers KernelBench level1/4_Matrix_vector_multiplication_ (C = A @ B, A of M x K, B of K x 1).

One block per row of A streams the row with 16-byte loads (four in flight per thread) against B,
which stays in L2; per-thread partial dot products are reduced with warp shuffles and shared memory.
"""

from torch import nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor matvec_forward(torch::Tensor A, torch::Tensor B);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cstdint>

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Rows are handled by a grid-stride loop over blocks, so any M works with a capped grid.
// VEC: both A's rows and B are 16-byte aligned and K % 4 == 0.
template <bool VEC>
__global__ void __launch_bounds__(512)
matvec_kernel(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
              int64_t M, int64_t K) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
        const float* a = A + row * K;
        float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
        if (VEC) {
            const float4* a4 = reinterpret_cast<const float4*>(a);
            const float4* b4 = reinterpret_cast<const float4*>(B);
            const int64_t k4 = K >> 2;
            const int64_t step = blockDim.x;
            int64_t i = threadIdx.x;
            for (; i + 3 * step < k4; i += 4 * step) {
                const float4 x0 = __ldcs(a4 + i), x1 = __ldcs(a4 + i + step);
                const float4 x2 = __ldcs(a4 + i + 2 * step), x3 = __ldcs(a4 + i + 3 * step);
                const float4 y0 = __ldg(b4 + i), y1 = __ldg(b4 + i + step);
                const float4 y2 = __ldg(b4 + i + 2 * step), y3 = __ldg(b4 + i + 3 * step);
                acc0 = fmaf(x0.x, y0.x, fmaf(x0.y, y0.y, fmaf(x0.z, y0.z, fmaf(x0.w, y0.w, acc0))));
                acc1 = fmaf(x1.x, y1.x, fmaf(x1.y, y1.y, fmaf(x1.z, y1.z, fmaf(x1.w, y1.w, acc1))));
                acc2 = fmaf(x2.x, y2.x, fmaf(x2.y, y2.y, fmaf(x2.z, y2.z, fmaf(x2.w, y2.w, acc2))));
                acc3 = fmaf(x3.x, y3.x, fmaf(x3.y, y3.y, fmaf(x3.z, y3.z, fmaf(x3.w, y3.w, acc3))));
            }
            for (; i < k4; i += step) {
                const float4 x0 = __ldcs(a4 + i);
                const float4 y0 = __ldg(b4 + i);
                acc0 = fmaf(x0.x, y0.x, fmaf(x0.y, y0.y, fmaf(x0.z, y0.z, fmaf(x0.w, y0.w, acc0))));
            }
        } else {
            for (int64_t k = threadIdx.x; k < K; k += blockDim.x) acc0 = fmaf(a[k], B[k], acc0);
        }
        float v = warp_sum((acc0 + acc1) + (acc2 + acc3));
        if (lane == 0) partial[wid] = v;
        __syncthreads();
        if (wid == 0) {
            v = lane < nwarps ? partial[lane] : 0.0f;
            v = warp_sum(v);
            if (lane == 0) C[row] = v;
        }
        __syncthreads();
    }
}

torch::Tensor matvec_forward(torch::Tensor A, torch::Tensor B) {
    TORCH_CHECK(A.is_cuda() && B.is_cuda(), "A and B must be CUDA tensors");
    TORCH_CHECK(A.scalar_type() == torch::kFloat && B.scalar_type() == torch::kFloat, "float32 only");
    TORCH_CHECK(A.dim() == 2 && B.dim() == 2 && B.size(1) == 1, "A must be M x K and B K x 1");
    TORCH_CHECK(A.size(1) == B.size(0), "inner dimensions must match");
    A = A.contiguous();
    B = B.contiguous();
    const int64_t M = A.size(0), K = A.size(1);
    auto C = torch::empty({M, 1}, A.options());
    if (M == 0) return C;
    const float* a = A.data_ptr<float>();
    const float* b = B.data_ptr<float>();
    const bool vec = (K % 4 == 0) && ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
    const int threads = 512;
    const unsigned blocks = (unsigned)std::min<int64_t>(M, 1 << 20);
    auto stream = at::cuda::getCurrentCUDAStream();
    if (vec) matvec_kernel<true><<<blocks, threads, 0, stream>>>(a, b, C.data_ptr<float>(), M, K);
    else matvec_kernel<false><<<blocks, threads, 0, stream>>>(a, b, C.data_ptr<float>(), M, K);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return C;
}
"""

matvec_ext = load_inline(
    name="kiln_kb_honest_l1_4_matvec",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["matvec_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return matvec_ext.matvec_forward(A, B)
