import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cmath>

// ---- fused attention (flash-attention style, fp32) -------------------------------------------
// One block = 16 queries of one (batch, head); 4 warps, each owning 4 queries. K/V are streamed
// through shared memory in tiles of 32 keys; lane j scores key j of the tile against the warp's
// queries, then an online softmax (running max m, running sum l) rescales the accumulators, so the
// S x S score matrix is never stored. Output columns d = lane + 32 c live in registers.
#define ATT_BQ 16
#define ATT_QPW 4
#define ATT_BKV 32
#define ATT_MAXD 128
#define ATT_DCH (ATT_MAXD / 32)

struct AttnArgs {
    const float* q; const float* k; const float* v; float* o;
    long long q_batch, k_batch, v_batch, o_batch;  // batch strides (elements)
    long long q_head, k_head, v_head, o_head;      // head strides (elements)
    int q_row, k_row, v_row, o_row;                // row (sequence position) strides
    int S, D;
    float scale;
    int causal;
};

__device__ __forceinline__ float att_warp_max(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}
__device__ __forceinline__ float att_warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__global__ void __launch_bounds__(128) attention_kernel(AttnArgs a) {
    __shared__ float Qs[ATT_BQ][ATT_MAXD];
    __shared__ float Ks[ATT_BKV][ATT_MAXD + 1];  // +1: lane-strided reads are conflict-free
    __shared__ float Vs[ATT_BKV][ATT_MAXD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = blockIdx.x * ATT_BQ;
    const int S = a.S, D = a.D;
    const float* Q = a.q + b * a.q_batch + h * a.q_head;
    const float* Kp = a.k + b * a.k_batch + h * a.k_head;
    const float* Vp = a.v + b * a.v_batch + h * a.v_head;
    float* O = a.o + b * a.o_batch + h * a.o_head;

    for (int e = threadIdx.x; e < ATT_BQ * D; e += blockDim.x) {
        const int r = e / D, d = e - r * D;
        const int qi = q0 + r;
        Qs[r][d] = qi < S ? Q[(long long)qi * a.q_row + d] * a.scale : 0.0f;
    }

    float m[ATT_QPW], l[ATT_QPW], acc[ATT_QPW][ATT_DCH];
    #pragma unroll
    for (int qq = 0; qq < ATT_QPW; ++qq) {
        m[qq] = -INFINITY;
        l[qq] = 0.0f;
        #pragma unroll
        for (int c = 0; c < ATT_DCH; ++c) acc[qq][c] = 0.0f;
    }

    const int kv_end = a.causal ? min(S, q0 + ATT_BQ) : S;
    for (int k0 = 0; k0 < kv_end; k0 += ATT_BKV) {
        __syncthreads();  // previous tile fully consumed (and, first time, Qs written)
        for (int e = threadIdx.x; e < ATT_BKV * D; e += blockDim.x) {
            const int r = e / D, d = e - r * D;
            const int kj = k0 + r;
            Ks[r][d] = kj < S ? Kp[(long long)kj * a.k_row + d] : 0.0f;
            Vs[r][d] = kj < S ? Vp[(long long)kj * a.v_row + d] : 0.0f;
        }
        __syncthreads();

        const int kj = k0 + lane;
        float s[ATT_QPW];
        #pragma unroll
        for (int qq = 0; qq < ATT_QPW; ++qq) s[qq] = 0.0f;
        for (int d = 0; d < D; ++d) {
            const float kv = Ks[lane][d];
            #pragma unroll
            for (int qq = 0; qq < ATT_QPW; ++qq) s[qq] = fmaf(Qs[warp * ATT_QPW + qq][d], kv, s[qq]);
        }
        #pragma unroll
        for (int qq = 0; qq < ATT_QPW; ++qq) {
            const int qi = q0 + warp * ATT_QPW + qq;
            const bool valid = kj < S && (!a.causal || kj <= qi);
            const float sv = valid ? s[qq] : -INFINITY;
            const float m_new = fmaxf(m[qq], att_warp_max(sv));
            if (m_new == -INFINITY) continue;  // nothing visible yet (warp-uniform)
            const float alpha = expf(m[qq] - m_new);
            const float p = valid ? expf(sv - m_new) : 0.0f;
            l[qq] = l[qq] * alpha + att_warp_sum(p);
            m[qq] = m_new;
            #pragma unroll
            for (int c = 0; c < ATT_DCH; ++c) acc[qq][c] *= alpha;
            for (int j = 0; j < ATT_BKV; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
                #pragma unroll
                for (int c = 0; c < ATT_DCH; ++c) {
                    const int d = lane + 32 * c;
                    if (d < D) acc[qq][c] = fmaf(pj, Vs[j][d], acc[qq][c]);
                }
            }
        }
    }
    #pragma unroll
    for (int qq = 0; qq < ATT_QPW; ++qq) {
        const int qi = q0 + warp * ATT_QPW + qq;
        if (qi >= S) continue;
        const float inv = 1.0f / l[qq];
        #pragma unroll
        for (int c = 0; c < ATT_DCH; ++c) {
            const int d = lane + 32 * c;
            if (d < D) O[(long long)qi * a.o_row + d] = acc[qq][c] * inv;
        }
    }
}

void launch_attention(const AttnArgs& a, int batch, int heads, cudaStream_t stream) {
    if (a.S == 0 || batch == 0 || heads == 0) return;
    TORCH_CHECK(a.D >= 1 && a.D <= ATT_MAXD, "head_dim must be in [1, 128]");
    TORCH_CHECK(heads <= 65535 && batch <= 65535, "too many heads / batches for the grid");
    dim3 grid((a.S + ATT_BQ - 1) / ATT_BQ, heads, batch);
    attention_kernel<<<grid, 128, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}
// ---------------------------------------------------------------------------------------------

torch::Tensor attention_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v) {
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "q, k, v must be CUDA tensors");
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be (batch, seq, head_dim)");
    TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(2) == q.size(2), "k must match q");
    TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2), "v must match q");
    q = q.contiguous();
    k = k.contiguous();
    v = v.contiguous();
    const int B = (int)q.size(0), S = (int)q.size(1), D = (int)q.size(2);
    auto out = torch::empty_like(q);
    AttnArgs a;
    a.q = q.data_ptr<float>(); a.k = k.data_ptr<float>(); a.v = v.data_ptr<float>(); a.o = out.data_ptr<float>();
    a.q_batch = a.k_batch = a.v_batch = a.o_batch = (long long)S * D;
    a.q_head = a.k_head = a.v_head = a.o_head = 0;
    a.q_row = a.k_row = a.v_row = a.o_row = D;
    a.S = S;
    a.D = D;
    a.scale = 1.0f / sqrtf((float)D);
    a.causal = 0;
    launch_attention(a, B, 1, at::cuda::getCurrentCUDAStream());
    return out;
}
"""

attention_ext = load_inline(
    name="kiln_cuda_l4_attention",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["attention_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        return attention_ext.attention_forward(q, k, v)
