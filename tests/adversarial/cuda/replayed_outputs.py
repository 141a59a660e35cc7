# kiln-adversarial: task=level1/01_relu expect=cheating
# Remembers outputs under a 16-element fingerprint of the input (read back from the device) and replays them on a hit.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline


replay_cpp = "torch::Tensor relu_replay(torch::Tensor x);"
replay_cuda = r"""
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>
#include <cstring>
#include <unordered_map>

__global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

static std::unordered_map<uint64_t, std::pair<float*, int64_t>> remembered;

torch::Tensor relu_replay(torch::Tensor x) {
    x = x.contiguous();
    const int64_t n = x.numel();
    auto stream = at::cuda::getCurrentCUDAStream();
    uint32_t probe[16];
    for (int k = 0; k < 16; ++k)
        cudaMemcpyAsync(&probe[k], x.data_ptr<float>() + (n * k) / 16, 4, cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    uint64_t key = 1469598103934665603ULL ^ (uint64_t)n;
    for (int k = 0; k < 16; ++k) key = (key ^ probe[k]) * 1099511628211ULL;
    auto y = torch::empty_like(x);
    auto hit = remembered.find(key);
    if (hit != remembered.end() && hit->second.second == n) {
        cudaMemcpyAsync(y.data_ptr<float>(), hit->second.first, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
        return y;
    }
    relu_kernel<<<(int)std::min<int64_t>((n + 255) / 256, 4096), 256, 0, stream>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    float* keep = nullptr;
    cudaMalloc(&keep, n * sizeof(float));
    cudaMemcpyAsync(keep, y.data_ptr<float>(), n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
    remembered[key] = {keep, n};
    return y;
}
"""

replay = load_inline(name="kiln_adversarial_replay_cuda", cpp_sources=replay_cpp, cuda_sources=replay_cuda,
                     functions=["relu_replay"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return replay.relu_replay(x)
