import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor matmul_tb_forward(torch::Tensor A, torch::Tensor B);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>

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

struct StoreEpilogue {
    __device__ __forceinline__ float operator()(float v, int, int, int) const { return v; }
};

// C = A @ B^T with A (M x K) and B (N x K): the TRANS_B tile loader reads B rows directly.
torch::Tensor matmul_tb_forward(torch::Tensor A, torch::Tensor B) {
    TORCH_CHECK(A.is_cuda() && B.is_cuda(), "A and B must be CUDA tensors");
    TORCH_CHECK(A.dim() == 2 && B.dim() == 2, "A and B must be 2-D");
    TORCH_CHECK(A.size(1) == B.size(1), "A and B must have the same number of columns");
    A = A.contiguous();
    B = B.contiguous();
    const int M = (int)A.size(0), K = (int)A.size(1), N = (int)B.size(0);
    auto C = torch::empty({M, N}, A.options());
    launch_sgemm<true>(A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(), M, N, K, K, K, N,
                       0, 0, 0, 1, StoreEpilogue{}, at::cuda::getCurrentCUDAStream());
    return C;
}
"""

matmul_tb_ext = load_inline(
    name="kiln_cuda_l3_matmul_transposed_b",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["matmul_tb_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return matmul_tb_ext.matmul_tb_forward(A, B)
