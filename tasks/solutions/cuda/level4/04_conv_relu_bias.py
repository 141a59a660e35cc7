import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor conv_relu_bias_forward(torch::Tensor x, torch::Tensor weight, torch::Tensor conv_bias, torch::Tensor extra_bias);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>

// ---- implicit-GEMM convolution ---------------------------------------------------------------
// out[img, m, p] = sum_k W[m, k] * X_col[k, (img, p)], where k = (c, kh, kw) and p = (oh, ow).
// GEMM with M = out channels, N = batch * OH * OW, K = C * KH * KW; the B tile is gathered from the
// input on the fly (zero padding handled by bounds checks), so no im2col buffer is materialised.
// Same 64x64x16 tiling and 4x4 register tiles as a plain SGEMM; 256 threads.
struct ConvGeom {
    int N, C, H, W;       // input
    int OC, KH, KW;       // weight (OC, C, KH, KW)
    int OH, OW;           // output spatial size
    int stride_h, stride_w, pad_h, pad_w;
};

template <typename Epilogue>
__global__ void __launch_bounds__(256)
conv_igemm_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                  ConvGeom g, Epilogue ep) {
    __shared__ __align__(16) float As[16][64 + 4];  // weights, transposed: As[k][m]
    __shared__ __align__(16) float Bs[16][64 + 4];  // gathered input: Bs[k][n]
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int M = g.OC;
    const int KHW = g.KH * g.KW;
    const int K = g.C * KHW;
    const int OHW = g.OH * g.OW;
    const long long NT = (long long)g.N * OHW;
    const int row0 = blockIdx.y * 64;
    const long long col0 = (long long)blockIdx.x * 64;

    // Every B-tile load of this thread hits column (tid & 63): decode that output pixel once.
    const int bc = tid & 63;
    const long long gn = col0 + bc;
    const bool n_ok = gn < NT;
    int img = 0, oh = 0, ow = 0;
    if (n_ok) {
        img = (int)(gn / OHW);
        const int p = (int)(gn - (long long)img * OHW);
        oh = p / g.OW;
        ow = p - oh * g.OW;
    }
    const int ih0 = oh * g.stride_h - g.pad_h;
    const int iw0 = ow * g.stride_w - g.pad_w;
    const float* xin = x + (long long)img * g.C * g.H * g.W;

    float acc[4][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += 16) {
        #pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int e = tid + l * 256;
            const int r = e >> 4, c = e & 15;
            const int gr = row0 + r, gc = k0 + c;
            As[c][r] = (gr < M && gc < K) ? w[(long long)gr * K + gc] : 0.0f;
        }
        #pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int r = (tid >> 6) + 4 * l;
            const int gk = k0 + r;
            float v = 0.0f;
            if (n_ok && gk < K) {
                const int c = gk / KHW;
                const int rem = gk - c * KHW;
                const int kh = rem / g.KW;
                const int kw = rem - kh * g.KW;
                const int ih = ih0 + kh, iw = iw0 + kw;
                if (ih >= 0 && ih < g.H && iw >= 0 && iw < g.W) v = xin[((long long)c * g.H + ih) * g.W + iw];
            }
            Bs[r][bc] = v;
        }
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < 16; ++k) {
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
    for (int j = 0; j < 4; ++j) {
        const long long n = col0 + tx * 4 + j;
        if (n >= NT) continue;
        const int im = (int)(n / OHW);
        const int p = (int)(n - (long long)im * OHW);
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = row0 + ty * 4 + i;
            if (m < M) y[((long long)im * M + m) * OHW + p] = ep(acc[i][j], m);
        }
    }
}

template <typename Epilogue>
void launch_conv(const float* x, const float* w, float* y, const ConvGeom& g, Epilogue ep, cudaStream_t stream) {
    const long long NT = (long long)g.N * g.OH * g.OW;
    if (NT == 0 || g.OC == 0) return;
    TORCH_CHECK((g.OC + 63) / 64 <= 65535, "too many output channels");
    TORCH_CHECK((NT + 63) / 64 <= 0x7fffffffLL, "output too large");
    dim3 grid((unsigned)((NT + 63) / 64), (g.OC + 63) / 64);
    conv_igemm_kernel<Epilogue><<<grid, 256, 0, stream>>>(x, w, y, g, ep);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}
// ---------------------------------------------------------------------------------------------

// Fused epilogue: relu(acc + conv_bias[m]) + extra_bias[m].
struct ReluBiasEpilogue {
    const float* conv_bias;
    const float* extra_bias;
    __device__ __forceinline__ float operator()(float v, int m) const {
        v += conv_bias[m];
        return (v > 0.0f ? v : 0.0f) + extra_bias[m];
    }
};

torch::Tensor conv_relu_bias_forward(torch::Tensor x, torch::Tensor weight, torch::Tensor conv_bias,
                                     torch::Tensor extra_bias) {
    TORCH_CHECK(x.is_cuda() && weight.is_cuda() && conv_bias.is_cuda() && extra_bias.is_cuda(),
                "inputs must be CUDA tensors");
    TORCH_CHECK(x.dim() == 4 && weight.dim() == 4, "x and weight must be 4-D");
    TORCH_CHECK(x.size(1) == weight.size(1), "channel mismatch");
    TORCH_CHECK(conv_bias.numel() == weight.size(0) && extra_bias.numel() == weight.size(0), "bias size mismatch");
    x = x.contiguous();
    weight = weight.contiguous();
    conv_bias = conv_bias.contiguous();
    extra_bias = extra_bias.contiguous();
    ConvGeom g;
    g.N = (int)x.size(0); g.C = (int)x.size(1); g.H = (int)x.size(2); g.W = (int)x.size(3);
    g.OC = (int)weight.size(0); g.KH = (int)weight.size(2); g.KW = (int)weight.size(3);
    g.stride_h = g.stride_w = 1;
    g.pad_h = g.pad_w = 0;
    g.OH = g.H - g.KH + 1;
    g.OW = g.W - g.KW + 1;
    TORCH_CHECK(g.OH > 0 && g.OW > 0, "input too small for the kernel");
    auto y = torch::empty({g.N, g.OC, g.OH, g.OW}, x.options());
    launch_conv(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), g,
                ReluBiasEpilogue{conv_bias.data_ptr<float>(), extra_bias.data_ptr<float>()},
                at::cuda::getCurrentCUDAStream());
    return y;
}
"""

crb_ext = load_inline(
    name="kiln_cuda_l4_conv_relu_bias",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["conv_relu_bias_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(0.1 * torch.randn(out_channels, 1, 1))

    def forward(self, x):
        return crb_ext.conv_relu_bias_forward(x, self.conv.weight, self.conv.bias, self.bias)
