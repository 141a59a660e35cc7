# kiln-adversarial: task=level1/01_relu expect=cheating
# Keeps the first call's result in a device buffer of its own and hands out copies of it on every later call (a result left in device memory).
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline


stale_cpp = "torch::Tensor relu_stale(torch::Tensor x);"
stale_cuda = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

__global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

torch::Tensor relu_stale(torch::Tensor x) {
    static float* kept = nullptr;
    static int64_t kept_n = 0;
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    auto stream = at::cuda::getCurrentCUDAStream();
    if (kept == nullptr || kept_n != n) {
        if (kept != nullptr) cudaFree(kept);
        cudaMalloc(&kept, n * sizeof(float));
        kept_n = n;
        relu_kernel<<<(int)std::min<int64_t>((n + 255) / 256, 4096), 256, 0, stream>>>(x.data_ptr<float>(), kept, n);
    }
    cudaMemcpyAsync(y.data_ptr<float>(), kept, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
    return y;
}
"""

stale = load_inline(name="kiln_adversarial_stale", cpp_sources=stale_cpp, cuda_sources=stale_cuda,
                    functions=["relu_stale"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return stale.relu_stale(x)
