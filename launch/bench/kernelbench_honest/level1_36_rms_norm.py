"""Answers KernelBench level1/36_RMSNorm_ (x / sqrt(mean(x^2 over dim 1) + eps) for x of (B, C, *)).

Each thread owns one (batch, position) column: with C <= 64 it loads the column's C values into
registers once (coalesced across threads), reduces them and writes the scaled values, so x is read
once; a wider C falls back to reading the column twice.
"""

from torch import nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor rmsnorm_forward(torch::Tensor x, double eps);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cstdint>

#define THREADS 256

// CMAX > 0: the column (C <= CMAX values) is held in registers; CMAX == 0: two passes over memory.
template <int CMAX>
__global__ void __launch_bounds__(THREADS)
rms_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t outer, int C, int64_t inner, float eps) {
    const int64_t cols = outer * inner;
    const float invC = 1.0f / (float)C;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < cols; t += (int64_t)gridDim.x * blockDim.x) {
        const int64_t o = t / inner, p = t - o * inner;
        const float* in = x + o * (int64_t)C * inner + p;
        float* out = y + o * (int64_t)C * inner + p;
        if (CMAX > 0) {
            float v[CMAX > 0 ? CMAX : 1];
            float acc = 0.0f;
            #pragma unroll
            for (int c = 0; c < CMAX; ++c) {
                v[c] = c < C ? __ldcs(in + c * inner) : 0.0f;
                acc = fmaf(v[c], v[c], acc);
            }
            const float rms = sqrtf(acc * invC + eps);
            #pragma unroll
            for (int c = 0; c < CMAX; ++c)
                if (c < C) __stcs(out + c * inner, v[c] / rms);
        } else {
            float acc = 0.0f;
            for (int c = 0; c < C; ++c) {
                const float v = in[c * inner];
                acc = fmaf(v, v, acc);
            }
            const float rms = sqrtf(acc * invC + eps);
            for (int c = 0; c < C; ++c) out[c * inner] = in[c * inner] / rms;
        }
    }
}

torch::Tensor rmsnorm_forward(torch::Tensor x, double eps) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "float32 only");
    TORCH_CHECK(x.dim() >= 2, "x must be (batch, features, ...)");
    x = x.contiguous();
    auto y = torch::empty_like(x);
    if (x.numel() == 0) return y;
    const int64_t outer = x.size(0);
    const int64_t C = x.size(1);
    TORCH_CHECK(C <= (int64_t)1 << 30, "too many features");
    const int64_t inner = x.numel() / (outer * C);
    const int64_t cols = outer * inner;
    const unsigned blocks = (unsigned)std::min<int64_t>((cols + THREADS - 1) / THREADS, 1 << 22);
    auto stream = at::cuda::getCurrentCUDAStream();
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    if (C <= 16) rms_kernel<16><<<blocks, THREADS, 0, stream>>>(xp, yp, outer, (int)C, inner, (float)eps);
    else if (C <= 64) rms_kernel<64><<<blocks, THREADS, 0, stream>>>(xp, yp, outer, (int)C, inner, (float)eps);
    else rms_kernel<0><<<blocks, THREADS, 0, stream>>>(xp, yp, outer, (int)C, inner, (float)eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

rmsnorm_ext = load_inline(
    name="kiln_kb_honest_l1_36_rms_norm",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["rmsnorm_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features = num_features
        self.eps = eps

    def forward(self, x):
        return rmsnorm_ext.rmsnorm_forward(x, float(self.eps))
