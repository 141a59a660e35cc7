"""Answers KernelBench level1/35_GroupNorm_ (nn.GroupNorm(num_groups, num_features), affine, eps 1e-5).

Each (sample, group) is a contiguous row: a chunked pass writes per-chunk fp64 sums and sums of
squares, a small pass turns them into mean and 1/std per group, and a chunked 16-byte pass applies
(x - mean) / std * weight + bias per channel plane. The GroupNorm module is kept for its parameters.
"""

from torch import nn
from torch.utils.cpp_extension import load_inline

cpp_source = (
    "torch::Tensor group_norm_forward(torch::Tensor x, std::optional<torch::Tensor> weight, "
    "std::optional<torch::Tensor> bias, int64_t groups, double eps);"
)

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#define THREADS 256
#define CHUNK 16384  // elements per block in the statistics and apply passes (a multiple of 4)

__device__ __forceinline__ double warp_sum(double v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Pass 1. Row r (a group of one sample: cpg channels x HW, contiguous) is split into S chunks; block
// (r, s) writes the sum and the sum of squares of its chunk (fp32 per thread, fp64 across threads).
__global__ void __launch_bounds__(THREADS)
stats_kernel(const float* __restrict__ x, int64_t R, int64_t L, int64_t S, bool vec, double2* __restrict__ partial) {
    __shared__ double sh_s[THREADS / 32], sh_q[THREADS / 32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (int64_t job = blockIdx.x; job < R * S; job += gridDim.x) {
        const int64_t r = job / S, s = job - r * S;
        const int64_t lo = s * CHUNK, hi = std::min<int64_t>(lo + CHUNK, L);
        const float* row = x + r * L;
        float sum = 0.0f, sq = 0.0f;
        if (vec) {  // L % 4 == 0 and x 16-byte aligned: every chunk starts on a float4
            const float4* r4 = reinterpret_cast<const float4*>(row + lo);
            const int64_t n4 = (hi - lo) >> 2;
            for (int64_t i = threadIdx.x; i < n4; i += THREADS) {
                const float4 v = r4[i];
                sum += (v.x + v.y) + (v.z + v.w);
                sq = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, sq))));
            }
        } else {
            for (int64_t i = lo + threadIdx.x; i < hi; i += THREADS) {
                const float v = row[i];
                sum += v;
                sq = fmaf(v, v, sq);
            }
        }
        double ds = warp_sum((double)sum), dq = warp_sum((double)sq);
        if (lane == 0) { sh_s[wid] = ds; sh_q[wid] = dq; }
        __syncthreads();
        if (threadIdx.x == 0) {
            ds = 0.0; dq = 0.0;
            #pragma unroll
            for (int w = 0; w < THREADS / 32; ++w) { ds += sh_s[w]; dq += sh_q[w]; }
            partial[job] = make_double2(ds, dq);
        }
        __syncthreads();
    }
}

// Pass 2. One thread per row: mean and 1/sqrt(biased variance + eps).
__global__ void finalize_kernel(const double2* __restrict__ partial, int64_t R, int64_t L, int64_t S, double eps,
                                float2* __restrict__ stats) {
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < R; r += (int64_t)gridDim.x * blockDim.x) {
        double s = 0.0, q = 0.0;
        for (int64_t i = 0; i < S; ++i) { const double2 p = partial[r * S + i]; s += p.x; q += p.y; }
        const double mean = s / (double)L;
        const double var = std::max(q / (double)L - mean * mean, 0.0);
        stats[r] = make_float2((float)mean, (float)(1.0 / sqrt(var + eps)));
    }
}

// Pass 3. Plane (n, c) of HW elements in chunks: y = x * a + b with a = rstd * gamma[c] and
// b = beta[c] - mean * a (gamma = 1 and beta = 0 without affine parameters).
__global__ void __launch_bounds__(THREADS)
apply_kernel(const float* __restrict__ x, float* __restrict__ y, const float2* __restrict__ stats,
             const float* __restrict__ gamma, const float* __restrict__ beta,
             int64_t planes, int64_t C, int64_t cpg, int64_t HW, int64_t S, bool vec) {
    for (int64_t job = blockIdx.x; job < planes * S; job += gridDim.x) {
        const int64_t pl = job / S, s = job - pl * S;
        const int64_t c = pl % C;
        const float2 st = stats[pl / cpg];
        const float a = st.y * (gamma ? gamma[c] : 1.0f);
        const float b = (beta ? beta[c] : 0.0f) - st.x * a;
        const int64_t lo = s * CHUNK, hi = std::min<int64_t>(lo + CHUNK, HW);
        const float* in = x + pl * HW;
        float* out = y + pl * HW;
        if (vec) {  // HW % 4 == 0, x and y 16-byte aligned
            const float4* i4 = reinterpret_cast<const float4*>(in + lo);
            float4* o4 = reinterpret_cast<float4*>(out + lo);
            const int64_t n4 = (hi - lo) >> 2;
            for (int64_t i = threadIdx.x; i < n4; i += THREADS) {
                float4 v = __ldcs(i4 + i);
                v.x = fmaf(v.x, a, b); v.y = fmaf(v.y, a, b); v.z = fmaf(v.z, a, b); v.w = fmaf(v.w, a, b);
                __stcs(o4 + i, v);
            }
        } else {
            for (int64_t i = lo + threadIdx.x; i < hi; i += THREADS) out[i] = fmaf(in[i], a, b);
        }
    }
}

// x: (N, C, *) contiguous; statistics over groups of C / groups channels and all positions.
torch::Tensor group_norm_forward(torch::Tensor x, std::optional<torch::Tensor> weight, std::optional<torch::Tensor> bias,
                                 int64_t groups, double eps) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "float32 only");
    TORCH_CHECK(x.dim() >= 2, "x must be (N, C, ...)");
    const int64_t N = x.size(0), C = x.size(1);
    TORCH_CHECK(groups > 0 && C % groups == 0, "channels must divide into groups");
    x = x.contiguous();
    auto y = torch::empty_like(x);
    if (x.numel() == 0) return y;
    const float* gamma = nullptr;
    const float* beta = nullptr;
    torch::Tensor w, b;
    if (weight.has_value() && weight->defined()) {
        w = weight->contiguous();
        TORCH_CHECK(w.is_cuda() && w.scalar_type() == torch::kFloat && w.numel() == C, "weight must be C floats on the device");
        gamma = w.data_ptr<float>();
    }
    if (bias.has_value() && bias->defined()) {
        b = bias->contiguous();
        TORCH_CHECK(b.is_cuda() && b.scalar_type() == torch::kFloat && b.numel() == C, "bias must be C floats on the device");
        beta = b.data_ptr<float>();
    }
    const int64_t HW = x.numel() / (N * C);
    const int64_t cpg = C / groups;
    const int64_t R = N * groups, L = cpg * HW;
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const bool aligned = ((reinterpret_cast<uintptr_t>(xp) | reinterpret_cast<uintptr_t>(yp)) & 15) == 0;
    auto stream = at::cuda::getCurrentCUDAStream();
    const int64_t S1 = (L + CHUNK - 1) / CHUNK;
    auto partial = torch::empty({R * S1 * 2}, x.options().dtype(torch::kDouble));
    auto stats = torch::empty({R * 2}, x.options());
    const unsigned cap = 1u << 24;
    stats_kernel<<<(unsigned)std::min<int64_t>(R * S1, cap), THREADS, 0, stream>>>(
        xp, R, L, S1, aligned && L % 4 == 0, reinterpret_cast<double2*>(partial.data_ptr<double>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    finalize_kernel<<<(unsigned)std::min<int64_t>((R + 127) / 128, cap), 128, 0, stream>>>(
        reinterpret_cast<const double2*>(partial.data_ptr<double>()), R, L, S1, eps,
        reinterpret_cast<float2*>(stats.data_ptr<float>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t S3 = (HW + CHUNK - 1) / CHUNK;
    apply_kernel<<<(unsigned)std::min<int64_t>(N * C * S3, cap), THREADS, 0, stream>>>(
        xp, yp, reinterpret_cast<const float2*>(stats.data_ptr<float>()), gamma, beta, N * C, C, cpg, HW, S3,
        aligned && HW % 4 == 0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

group_norm_ext = load_inline(
    name="kiln_kb_honest_l1_35_group_norm",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["group_norm_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, num_features: int, num_groups: int):
        super().__init__()
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=num_features)

    def forward(self, x):
        gn = self.gn
        return group_norm_ext.group_norm_forward(x, gn.weight, gn.bias, gn.num_groups, float(gn.eps))
