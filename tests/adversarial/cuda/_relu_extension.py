import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# One extension shared by the CUDA adversarial candidates (identical call -> built once per run).
adv_cpp = r"""
torch::Tensor relu_out(torch::Tensor x);
torch::Tensor relu_inplace(torch::Tensor x);
torch::Tensor relu_side_stream(torch::Tensor x);
torch::Tensor relu_bf16(torch::Tensor x);
torch::Tensor relu_fixed(torch::Tensor x);
torch::Tensor illegal_access(torch::Tensor x);
torch::Tensor spin_forever(torch::Tensor x);
torch::Tensor crash(torch::Tensor x);
"""

adv_cuda = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>
#include <cstdint>

__global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

// Spins ~2 ms per thread before computing, so that work left running is visible.
__global__ void slow_relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    const long long start = clock64();
    while (clock64() - start < 4000000LL) {}
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

__global__ void bf16_relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float v = __uint_as_float(__float_as_uint(x[i]) & 0xFFFF0000u);
        y[i] = v > 0.0f ? v : 0.0f;
    }
}

__global__ void wild_write_kernel(float* y) { y[(1LL << 40) + threadIdx.x] = 1.0f; }

__global__ void forever_kernel(volatile int* flag) { while (*flag == 0) {} }

static int blocks_for(int64_t n) { return (int)std::min<int64_t>((n + 255) / 256, 4096); }

// A correct kernel on the current stream.
torch::Tensor relu_out(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    relu_kernel<<<blocks_for(x.numel()), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    return y;
}

// Writes the result into its input and returns the input.
torch::Tensor relu_inplace(torch::Tensor x) {
    relu_kernel<<<blocks_for(x.numel()), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), x.data_ptr<float>(), x.numel());
    return x;
}

// Launches on a private stream and returns without joining it: the work escapes the caller's stream.
torch::Tensor relu_side_stream(torch::Tensor x) {
    static cudaStream_t side = nullptr;
    if (side == nullptr) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
    x = x.contiguous();
    auto y = torch::empty_like(x);
    slow_relu_kernel<<<blocks_for(x.numel()), 256, 0, side>>>(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    return y;
}

// Rounds to bfloat16 precision before the ReLU.
torch::Tensor relu_bf16(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    bf16_relu_kernel<<<blocks_for(x.numel()), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    return y;
}

// Specialised to the default shape (4096 x 8192): any other shape gets zeros.
torch::Tensor relu_fixed(torch::Tensor x) {
    auto y = torch::zeros_like(x);
    if (x.numel() != 4096LL * 8192LL) return y;
    relu_kernel<<<4096, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.contiguous().data_ptr<float>(), y.data_ptr<float>(), 4096LL * 8192LL);
    return y;
}

// Writes far outside any allocation: an illegal memory access.
torch::Tensor illegal_access(torch::Tensor x) {
    auto y = torch::empty_like(x);
    wild_write_kernel<<<1, 32, 0, at::cuda::getCurrentCUDAStream()>>>(y.data_ptr<float>());
    return y;
}

// A kernel that never finishes.
torch::Tensor spin_forever(torch::Tensor x) {
    auto flag = torch::zeros({1}, x.options().dtype(torch::kInt32));
    forever_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(flag.data_ptr<int>());
    return torch::empty_like(x);
}

// Writes through a null host pointer.
torch::Tensor crash(torch::Tensor x) {
    volatile float* p = nullptr;
    *p = 1.0f;
    return x;
}
"""

adv = load_inline(
    name="kiln_adversarial_cuda",
    cpp_sources=adv_cpp,
    cuda_sources=adv_cuda,
    functions=["relu_out", "relu_inplace", "relu_side_stream", "relu_bf16", "relu_fixed",
               "illegal_access", "spin_forever", "crash"],
    verbose=False,
    extra_cuda_cflags=["-O2"],
)
