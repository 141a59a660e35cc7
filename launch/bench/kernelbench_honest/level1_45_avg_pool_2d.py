"""Answers KernelBench level1/45_Average_Pooling_2D (nn.AvgPool2d(kernel_size, stride, padding), defaults).

One block per (plane, output row): its threads sum the window's input rows column by column with
16-byte streaming loads into shared memory (each input row is read once when stride == kernel), then
each thread sums one output's window of column sums and divides by the padded window size
(count_include_pad). Rows wider than shared memory allows fall back to one thread per output.
"""

from torch import nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor avg_pool2d_forward(torch::Tensor x, int64_t kernel, int64_t stride, int64_t padding);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#define THREADS 256
#define MAX_SMEM_W 12288  // floats of column sums in shared memory (48 KiB)

struct Pool {
    int64_t planes;
    int H, W, OH, OW, k, s, p;
};

// Output (oh, ow) of a plane: window rows [oh*s - p, min(.. + k, H + p)), clipped to the input; the divisor
// is the window's size before clipping to the input (PyTorch's count_include_pad = True).
__global__ void __launch_bounds__(THREADS)
pool_rows_kernel(const float* __restrict__ x, float* __restrict__ y, Pool g, bool vec) {
    extern __shared__ float colsum[];
    const int64_t jobs = g.planes * g.OH;
    for (int64_t job = blockIdx.x; job < jobs; job += gridDim.x) {
        const int64_t plane = job / g.OH;
        const int oh = (int)(job - plane * g.OH);
        const int hs = oh * g.s - g.p;
        const int he = std::min(hs + g.k, g.H + g.p);
        const int pool_h = he - hs;
        const int h0 = std::max(hs, 0), h1 = std::min(he, g.H);
        const float* in = x + plane * g.H * (int64_t)g.W;
        if (vec) {  // W % 4 == 0 and x 16-byte aligned: every row starts on a float4
            const int W4 = g.W >> 2;
            for (int j = threadIdx.x; j < W4; j += THREADS) {
                float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
                #pragma unroll 4
                for (int h = h0; h < h1; ++h) {
                    const float4 v = __ldcs(reinterpret_cast<const float4*>(in + (int64_t)h * g.W) + j);
                    acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
                }
                reinterpret_cast<float4*>(colsum)[j] = acc;
            }
        } else {
            for (int j = threadIdx.x; j < g.W; j += THREADS) {
                float acc = 0.f;
                #pragma unroll 4
                for (int h = h0; h < h1; ++h) acc += __ldcs(in + (int64_t)h * g.W + j);
                colsum[j] = acc;
            }
        }
        __syncthreads();
        float* out = y + (plane * g.OH + oh) * (int64_t)g.OW;
        for (int ow = threadIdx.x; ow < g.OW; ow += THREADS) {
            const int ws = ow * g.s - g.p;
            const int we = std::min(ws + g.k, g.W + g.p);
            const int pool = pool_h * (we - ws);
            const int w0 = std::max(ws, 0), w1 = std::min(we, g.W);
            float acc = 0.f;
            for (int w = w0; w < w1; ++w) acc += colsum[w];
            out[ow] = acc / (float)pool;
        }
        __syncthreads();  // colsum is rewritten by the next job
    }
}

// Fallback for very wide rows: one thread per output element.
__global__ void pool_naive_kernel(const float* __restrict__ x, float* __restrict__ y, Pool g) {
    const int64_t total = g.planes * g.OH * (int64_t)g.OW;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
        const int ow = (int)(t % g.OW);
        const int64_t rest = t / g.OW;
        const int oh = (int)(rest % g.OH);
        const int64_t plane = rest / g.OH;
        const int hs = oh * g.s - g.p, ws = ow * g.s - g.p;
        const int he = std::min(hs + g.k, g.H + g.p), we = std::min(ws + g.k, g.W + g.p);
        const int pool = (he - hs) * (we - ws);
        const int h0 = std::max(hs, 0), h1 = std::min(he, g.H), w0 = std::max(ws, 0), w1 = std::min(we, g.W);
        const float* in = x + plane * g.H * (int64_t)g.W;
        float acc = 0.f;
        for (int h = h0; h < h1; ++h)
            for (int w = w0; w < w1; ++w) acc += in[(int64_t)h * g.W + w];
        y[t] = acc / (float)pool;
    }
}

torch::Tensor avg_pool2d_forward(torch::Tensor x, int64_t kernel, int64_t stride, int64_t padding) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "float32 only");
    TORCH_CHECK(x.dim() == 4 || x.dim() == 3, "x must be (N, C, H, W) or (C, H, W)");
    TORCH_CHECK(kernel > 0 && stride > 0 && padding >= 0 && padding <= kernel / 2, "bad pooling parameters");
    x = x.contiguous();
    const int64_t H = x.size(-2), W = x.size(-1);
    TORCH_CHECK(H < (1 << 30) && W < (1 << 30), "spatial size too large");
    const int64_t OH = (H + 2 * padding - kernel) / stride + 1;
    const int64_t OW = (W + 2 * padding - kernel) / stride + 1;
    TORCH_CHECK(OH > 0 && OW > 0, "input smaller than the pooling window");
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape[shape.size() - 2] = OH;
    shape[shape.size() - 1] = OW;
    auto y = torch::empty(shape, x.options());
    if (y.numel() == 0) return y;
    Pool g;
    g.planes = x.numel() / (H * W);
    g.H = (int)H; g.W = (int)W; g.OH = (int)OH; g.OW = (int)OW;
    g.k = (int)kernel; g.s = (int)stride; g.p = (int)padding;
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    auto stream = at::cuda::getCurrentCUDAStream();
    if (W <= MAX_SMEM_W) {
        const bool vec = W % 4 == 0 && (reinterpret_cast<uintptr_t>(xp) & 15) == 0;
        const int64_t jobs = g.planes * OH;
        const unsigned blocks = (unsigned)std::min<int64_t>(jobs, 1 << 24);
        pool_rows_kernel<<<blocks, THREADS, W * sizeof(float), stream>>>(xp, yp, g, vec);
    } else {
        const unsigned blocks = (unsigned)std::min<int64_t>((y.numel() + THREADS - 1) / THREADS, 1 << 24);
        pool_naive_kernel<<<blocks, THREADS, 0, stream>>>(xp, yp, g);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

avg_pool_ext = load_inline(
    name="kiln_kb_honest_l1_45_avg_pool_2d",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["avg_pool2d_forward"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, kernel_size: int, stride: int | None = None, padding: int = 0):
        super().__init__()
        self.kernel_size = int(kernel_size)
        self.stride = int(stride) if stride is not None else self.kernel_size
        self.padding = int(padding)

    def forward(self, x):
        return avg_pool_ext.avg_pool2d_forward(x, self.kernel_size, self.stride, self.padding)
