# kiln-adversarial: task=level2/06_rmsnorm expect=pass
# Honest: CUB's device-wide segmented reduction (its NVTX annotations import dlopen, refused as run-time lookup before) computes each row's sum of squares; its own kernels finish the norm.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = "torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor weight, double eps);"

cuda_source = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cub/device/device_segmented_reduce.cuh>

__global__ void squares(const float* __restrict__ x, float* __restrict__ s, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) s[i] = x[i] * x[i];
}

__global__ void offsets(int* o, int rows, int hidden) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= rows) o[i] = i * hidden;
}

__global__ void scale(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ sums,
                      float* __restrict__ y, int64_t n, int hidden, float eps) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / hidden;
        y[i] = x[i] * rsqrtf(sums[row] / hidden + eps) * w[i % hidden];
    }
}

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor weight, double eps) {
    x = x.contiguous();
    const int hidden = (int)x.size(-1);
    const int rows = (int)(x.numel() / hidden);
    const int64_t n = x.numel();
    auto stream = at::cuda::getCurrentCUDAStream();
    auto sq = torch::empty_like(x);
    auto sums = torch::empty({rows}, x.options());
    auto offs = torch::empty({rows + 1}, x.options().dtype(torch::kInt32));
    auto y = torch::empty_like(x);
    const int blocks = (int)std::min<int64_t>((n + 255) / 256, 4096);
    squares<<<blocks, 256, 0, stream>>>(x.data_ptr<float>(), sq.data_ptr<float>(), n);
    offsets<<<(rows + 256) / 256, 256, 0, stream>>>(offs.data_ptr<int>(), rows, hidden);
    size_t temp_bytes = 0;
    cub::DeviceSegmentedReduce::Sum(nullptr, temp_bytes, sq.data_ptr<float>(), sums.data_ptr<float>(), rows,
                                    offs.data_ptr<int>(), offs.data_ptr<int>() + 1, stream);
    auto temp = torch::empty({(int64_t)temp_bytes + 1}, x.options().dtype(torch::kUInt8));
    cub::DeviceSegmentedReduce::Sum(temp.data_ptr(), temp_bytes, sq.data_ptr<float>(), sums.data_ptr<float>(), rows,
                                    offs.data_ptr<int>(), offs.data_ptr<int>() + 1, stream);
    scale<<<blocks, 256, 0, stream>>>(x.data_ptr<float>(), weight.contiguous().data_ptr<float>(), sums.data_ptr<float>(),
                                      y.data_ptr<float>(), n, hidden, (float)eps);
    return y;
}
"""

ext = load_inline(name="kiln_adv_cub", cpp_sources=cpp_source, cuda_sources=cuda_source, functions=["rmsnorm"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        return ext.rmsnorm(x, self.weight, self.eps)
