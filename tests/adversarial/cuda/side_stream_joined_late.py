# kiln-adversarial: task=level1/01_relu expect=cheating
# Launches on a private stream and returns at once; joins that stream only at the start of the next call, so the work escapes the timed window.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline


late_cpp = "torch::Tensor relu_late_join(torch::Tensor x);"
late_cuda = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

__global__ void slow_relu(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    const long long start = clock64();
    while (clock64() - start < 4000000LL) {}
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

torch::Tensor relu_late_join(torch::Tensor x) {
    static cudaStream_t side = nullptr;
    static cudaEvent_t done = nullptr;
    if (side == nullptr) {
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    } else {
        cudaStreamWaitEvent(at::cuda::getCurrentCUDAStream(), done, 0);  // the previous call's work, joined late
    }
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    slow_relu<<<(int)std::min<int64_t>((n + 255) / 256, 4096), 256, 0, side>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    cudaEventRecord(done, side);
    return y;
}
"""

late = load_inline(name="kiln_adversarial_late_join", cpp_sources=late_cpp, cuda_sources=late_cuda,
                   functions=["relu_late_join"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return late.relu_late_join(x)
