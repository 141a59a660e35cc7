"""Answers KernelBench level1/39_L2Norm_ (x / ||x||_2, over dim 1).

The input is viewed as (outer, C, inner). For inner == 1 (the problem's 2-D shape) one block per
row reduces it (16-byte loads past an unaligned head) and then rescales it, the second read mostly
from L2; otherwise each thread owns one (outer, inner) column and walks C twice, coalesced.
"""

from torch import nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor l2norm_forward(torch::Tensor x);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cstdint>

__device__ __forceinline__ float term(float v) { return v * v; }
__device__ __forceinline__ float denom(float s, int64_t C) { return sqrtf(s); }

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// inner == 1: rows of length C, one block per row (grid-stride over rows). VEC: x and y are both
// 16-byte aligned, so each row has the same misalignment in both: a scalar head up to the first
// 16-byte boundary, float4 over the body, a scalar tail (rows of odd length such as 65535 included).
template <bool VEC>
__global__ void __launch_bounds__(1024)
row_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t rows, int64_t C) {
    __shared__ float partial[32];
    __shared__ float scale;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* in = x + r * C;
        float* out = y + r * C;
        int64_t head = C, body = 0;
        if (VEC) {
            head = std::min<int64_t>((4 - ((r * C) & 3)) & 3, C);
            body = (C - head) >> 2;
        }
        const int64_t tail0 = head + (body << 2);
        const float4* in4 = reinterpret_cast<const float4*>(in + head);
        float4* out4 = reinterpret_cast<float4*>(out + head);
        float acc = 0.0f, acc2 = 0.0f;
        for (int64_t i = threadIdx.x; i < head; i += blockDim.x) acc += term(in[i]);
        int64_t i = threadIdx.x;
        for (; i + blockDim.x < body; i += 2 * blockDim.x) {
            const float4 v = in4[i], w = in4[i + blockDim.x];
            acc += (term(v.x) + term(v.y)) + (term(v.z) + term(v.w));
            acc2 += (term(w.x) + term(w.y)) + (term(w.z) + term(w.w));
        }
        for (; i < body; i += blockDim.x) {
            const float4 v = in4[i];
            acc += (term(v.x) + term(v.y)) + (term(v.z) + term(v.w));
        }
        for (int64_t j = tail0 + threadIdx.x; j < C; j += blockDim.x) acc += term(in[j]);
        acc = warp_sum(acc + acc2);
        if (lane == 0) partial[wid] = acc;
        __syncthreads();
        if (wid == 0) {
            float v = lane < nwarps ? partial[lane] : 0.0f;
            v = warp_sum(v);
            if (lane == 0) scale = denom(v, C);
        }
        __syncthreads();
        const float d = scale;
        for (int64_t j = threadIdx.x; j < head; j += blockDim.x) out[j] = in[j] / d;
        for (int64_t j = threadIdx.x; j < body; j += blockDim.x) {
            float4 v = in4[j];
            v.x = v.x / d; v.y = v.y / d; v.z = v.z / d; v.w = v.w / d;
            __stcs(out4 + j, v);
        }
        for (int64_t j = tail0 + threadIdx.x; j < C; j += blockDim.x) out[j] = in[j] / d;
        __syncthreads();  // partial/scale are reused by the next row
    }
}

// inner > 1: one thread per (outer, inner) column, grid-stride over columns.
__global__ void col_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t outer, int64_t C, int64_t inner) {
    const int64_t cols = outer * inner;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < cols; t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t o = t / inner, p = t - o * inner;
        const float* in = x + o * C * inner + p;
        float* out = y + o * C * inner + p;
        float acc = 0.0f;
        for (int64_t c = 0; c < C; ++c) acc += term(in[c * inner]);
        const float d = denom(acc, C);
        for (int64_t c = 0; c < C; ++c) out[c * inner] = in[c * inner] / d;
    }
}

torch::Tensor l2norm_forward(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "float32 only");
    TORCH_CHECK(x.dim() >= 2, "x must have a dimension 1");
    x = x.contiguous();
    auto y = torch::empty_like(x);
    if (x.numel() == 0) return y;
    const int64_t outer = x.size(0), C = x.size(1);
    const int64_t inner = x.numel() / (outer * C);
    auto stream = at::cuda::getCurrentCUDAStream();
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    if (inner == 1) {
        const bool vec = ((reinterpret_cast<uintptr_t>(xp) | reinterpret_cast<uintptr_t>(yp)) & 15) == 0;
        const int threads = C >= 8192 ? 1024 : 256;
        const unsigned blocks = (unsigned)std::min<int64_t>(outer, 1 << 20);
        if (vec) row_kernel<true><<<blocks, threads, 0, stream>>>(xp, yp, outer, C);
        else row_kernel<false><<<blocks, threads, 0, stream>>>(xp, yp, outer, C);
    } else {
        const int threads = 256;
        const unsigned blocks = (unsigned)std::min<int64_t>((outer * inner + threads - 1) / threads, 1 << 20);
        col_kernel<<<blocks, threads, 0, stream>>>(xp, yp, outer, C, inner);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

l2norm_ext = load_inline(
    name="kiln_kb_honest_l1_39_l2_norm",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["l2norm_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return l2norm_ext.l2norm_forward(x)
