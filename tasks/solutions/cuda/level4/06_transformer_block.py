import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
torch::Tensor block_forward(torch::Tensor x, int64_t n_heads,
                            torch::Tensor ln1_w, torch::Tensor ln1_b, double ln1_eps,
                            torch::Tensor qkv_w, torch::Tensor qkv_b,
                            torch::Tensor proj_w, torch::Tensor proj_b,
                            torch::Tensor ln2_w, torch::Tensor ln2_b, double ln2_eps,
                            torch::Tensor fc1_w, torch::Tensor fc1_b,
                            torch::Tensor fc2_w, torch::Tensor fc2_b);
"""

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cmath>

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32); `sh` holds 33 floats. Safe to call repeatedly.
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

// LayerNorm over rows of width D, one block per row, two-pass mean / variance.
__global__ void layernorm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                 const float* __restrict__ b, float* __restrict__ y, int D, float eps) {
    __shared__ float sh[33];
    const float* row = x + (long long)blockIdx.x * D;
    float* out = y + (long long)blockIdx.x * D;
    float acc = 0.0f;
    for (int c = threadIdx.x; c < D; c += blockDim.x) acc += row[c];
    const float mean = block_sum(acc, sh) / (float)D;
    acc = 0.0f;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        const float d = row[c] - mean;
        acc = fmaf(d, d, acc);
    }
    const float rstd = rsqrtf(block_sum(acc, sh) / (float)D + eps);
    for (int c = threadIdx.x; c < D; c += blockDim.x) out[c] = (row[c] - mean) * rstd * w[c] + b[c];
}

// ---- tiled SGEMM ---------------------------------------------------------------------------
// C[z] (M x N) = A[z] (M x K, row stride lda) * op(B[z]); op(B) = B stored (K x N, row stride ldb),
// or with TRANS_B, B^T where B is stored (N x K, row stride ldb) (the nn.Linear weight layout).
// 64x64 output tile per block, K consumed in slices of 16 staged in shared memory, 256 threads,
// each thread owns a 4x4 register tile. Tiles are zero-filled past the edges, so any M, N, K work.
// The epilogue functor maps (accumulator, row, col, z) to the stored value.
#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_BK 16
#define GEMM_THREADS 256

template <bool TRANS_B, typename Epilogue>
__global__ void __launch_bounds__(GEMM_THREADS)
sgemm_kernel(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
             int M, int N, int K, int lda, int ldb, int ldc,
             long long stride_a, long long stride_b, long long stride_c, Epilogue ep) {
    __shared__ __align__(16) float As[GEMM_BK][GEMM_BM + 4];  // A tile, transposed: As[k][m]
    __shared__ __align__(16) float Bs[GEMM_BK][GEMM_BN + 4];  // B tile: Bs[k][n]
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int row0 = blockIdx.y * GEMM_BM, col0 = blockIdx.x * GEMM_BN;
    const int z = blockIdx.z;
    A += z * stride_a;
    B += z * stride_b;
    C += z * stride_c;

    float acc[4][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += GEMM_BK) {
        #pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int e = tid + l * GEMM_THREADS;
            const int r = e >> 4, c = e & 15;  // 64 rows x 16 k, k fastest (coalesced)
            const int gr = row0 + r, gc = k0 + c;
            As[c][r] = (gr < M && gc < K) ? A[(long long)gr * lda + gc] : 0.0f;
        }
        #pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int e = tid + l * GEMM_THREADS;
            if (!TRANS_B) {
                const int r = e >> 6, c = e & 63;  // 16 k x 64 n, n fastest (coalesced)
                const int gk = k0 + r, gn = col0 + c;
                Bs[r][c] = (gk < K && gn < N) ? B[(long long)gk * ldb + gn] : 0.0f;
            } else {
                const int c = e >> 4, r = e & 15;  // B stored N x K: k fastest (coalesced)
                const int gk = k0 + r, gn = col0 + c;
                Bs[r][c] = (gk < K && gn < N) ? B[(long long)gn * ldb + gk] : 0.0f;
            }
        }
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < GEMM_BK; ++k) {
            const float4 a4 = *reinterpret_cast<const float4*>(&As[k][ty * 4]);
            const float4 b4 = *reinterpret_cast<const float4*>(&Bs[k][tx * 4]);
            const float av[4] = {a4.x, a4.y, a4.z, a4.w};
            const float bv[4] = {b4.x, b4.y, b4.z, b4.w};
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = row0 + ty * 4 + i;
        if (r >= M) continue;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = col0 + tx * 4 + j;
            if (c < N) C[(long long)r * ldc + c] = ep(acc[i][j], r, c, z);
        }
    }
}

template <bool TRANS_B, typename Epilogue>
void launch_sgemm(const float* A, const float* B, float* C, int M, int N, int K, int lda, int ldb, int ldc,
                  long long stride_a, long long stride_b, long long stride_c, int batch, Epilogue ep,
                  cudaStream_t stream) {
    if (M <= 0 || N <= 0 || batch <= 0) return;
    TORCH_CHECK(batch <= 65535 && (M + GEMM_BM - 1) / GEMM_BM <= 65535, "problem too large for the grid");
    dim3 grid((N + GEMM_BN - 1) / GEMM_BN, (M + GEMM_BM - 1) / GEMM_BM, batch);
    sgemm_kernel<TRANS_B, Epilogue><<<grid, GEMM_THREADS, 0, stream>>>(
        A, B, C, M, N, K, lda, ldb, ldc, stride_a, stride_b, stride_c, ep);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}
// ---------------------------------------------------------------------------------------------

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

// Linear epilogues: bias, bias + exact GELU, bias + residual.
struct BiasEpilogue {
    const float* bias;
    __device__ __forceinline__ float operator()(float v, int, int c, int) const { return v + bias[c]; }
};
struct BiasGeluEpilogue {
    const float* bias;
    __device__ __forceinline__ float operator()(float v, int, int c, int) const {
        v += bias[c];
        return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    }
};
struct BiasResidualEpilogue {
    const float* bias;
    const float* res;
    int ld;
    __device__ __forceinline__ float operator()(float v, int r, int c, int) const {
        return v + bias[c] + res[(long long)r * ld + c];
    }
};

// x1 = x + proj(causal_mha(ln1(x)));  y = x1 + fc2(gelu(fc1(ln2(x1)))).
// Kernels: layernorm -> qkv GEMM(+bias) -> fused causal attention reading q/k/v in place from the
// qkv buffer -> proj GEMM(+bias+residual) -> layernorm -> fc1 GEMM(+bias+GELU) -> fc2 GEMM(+bias+residual).
torch::Tensor block_forward(torch::Tensor x, int64_t n_heads,
                            torch::Tensor ln1_w, torch::Tensor ln1_b, double ln1_eps,
                            torch::Tensor qkv_w, torch::Tensor qkv_b,
                            torch::Tensor proj_w, torch::Tensor proj_b,
                            torch::Tensor ln2_w, torch::Tensor ln2_b, double ln2_eps,
                            torch::Tensor fc1_w, torch::Tensor fc1_b,
                            torch::Tensor fc2_w, torch::Tensor fc2_b) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.dim() == 3, "x must be (batch, seq, d_model)");
    const int B = (int)x.size(0), T = (int)x.size(1), C = (int)x.size(2);
    TORCH_CHECK(n_heads > 0 && C % n_heads == 0, "d_model must be divisible by n_heads");
    const int H = (int)n_heads, Dh = C / H, F = (int)fc1_w.size(0);
    TORCH_CHECK(qkv_w.size(0) == 3 * C && qkv_w.size(1) == C, "qkv weight shape");
    TORCH_CHECK(proj_w.size(0) == C && proj_w.size(1) == C, "proj weight shape");
    TORCH_CHECK(fc1_w.size(1) == C && fc2_w.size(0) == C && fc2_w.size(1) == F, "mlp weight shapes");
    x = x.contiguous();
    ln1_w = ln1_w.contiguous(); ln1_b = ln1_b.contiguous();
    qkv_w = qkv_w.contiguous(); qkv_b = qkv_b.contiguous();
    proj_w = proj_w.contiguous(); proj_b = proj_b.contiguous();
    ln2_w = ln2_w.contiguous(); ln2_b = ln2_b.contiguous();
    fc1_w = fc1_w.contiguous(); fc1_b = fc1_b.contiguous();
    fc2_w = fc2_w.contiguous(); fc2_b = fc2_b.contiguous();
    auto out = torch::empty_like(x);
    const int rows = B * T;
    if (rows == 0) return out;
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    auto opts = x.options();
    auto h = torch::empty({rows, C}, opts);
    auto qkv = torch::empty({rows, 3 * C}, opts);
    auto att = torch::empty({rows, C}, opts);
    auto x1 = torch::empty({rows, C}, opts);
    auto f = torch::empty({rows, F}, opts);
    const int ln_threads = C >= 512 ? 256 : 128;

    layernorm_kernel<<<rows, ln_threads, 0, stream>>>(x.data_ptr<float>(), ln1_w.data_ptr<float>(),
                                                      ln1_b.data_ptr<float>(), h.data_ptr<float>(), C,
                                                      static_cast<float>(ln1_eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_sgemm<true>(h.data_ptr<float>(), qkv_w.data_ptr<float>(), qkv.data_ptr<float>(), rows, 3 * C, C,
                       C, C, 3 * C, 0, 0, 0, 1, BiasEpilogue{qkv_b.data_ptr<float>()}, stream);

    AttnArgs a;
    const float* qkv_p = qkv.data_ptr<float>();
    a.q = qkv_p; a.k = qkv_p + C; a.v = qkv_p + 2 * C; a.o = att.data_ptr<float>();
    a.q_batch = a.k_batch = a.v_batch = (long long)T * 3 * C;
    a.o_batch = (long long)T * C;
    a.q_head = a.k_head = a.v_head = a.o_head = Dh;
    a.q_row = a.k_row = a.v_row = 3 * C;
    a.o_row = C;
    a.S = T;
    a.D = Dh;
    a.scale = 1.0f / sqrtf((float)Dh);
    a.causal = 1;
    launch_attention(a, B, H, stream);

    launch_sgemm<true>(att.data_ptr<float>(), proj_w.data_ptr<float>(), x1.data_ptr<float>(), rows, C, C,
                       C, C, C, 0, 0, 0, 1,
                       BiasResidualEpilogue{proj_b.data_ptr<float>(), x.data_ptr<float>(), C}, stream);
    layernorm_kernel<<<rows, ln_threads, 0, stream>>>(x1.data_ptr<float>(), ln2_w.data_ptr<float>(),
                                                      ln2_b.data_ptr<float>(), h.data_ptr<float>(), C,
                                                      static_cast<float>(ln2_eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_sgemm<true>(h.data_ptr<float>(), fc1_w.data_ptr<float>(), f.data_ptr<float>(), rows, F, C,
                       C, C, F, 0, 0, 0, 1, BiasGeluEpilogue{fc1_b.data_ptr<float>()}, stream);
    launch_sgemm<true>(f.data_ptr<float>(), fc2_w.data_ptr<float>(), out.data_ptr<float>(), rows, C, F,
                       F, F, C, 0, 0, 0, 1,
                       BiasResidualEpilogue{fc2_b.data_ptr<float>(), x1.data_ptr<float>(), C}, stream);
    return out;
}
"""

block_ext = load_inline(
    name="kiln_cuda_l4_transformer_block",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["block_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, d_model, n_heads, mlp_ratio):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        # Same names, shapes and construction order as the reference, so seeding gives equal params.
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.add_(0.1 * torch.randn(d_model))
                ln.bias.add_(0.1 * torch.randn(d_model))

    def forward(self, x):
        return block_ext.block_forward(
            x, self.n_heads,
            self.ln1.weight, self.ln1.bias, self.ln1.eps,
            self.qkv.weight, self.qkv.bias,
            self.proj.weight, self.proj.bias,
            self.ln2.weight, self.ln2.bias, self.ln2.eps,
            self.fc1.weight, self.fc1.bias,
            self.fc2.weight, self.fc2.bias,
        )
