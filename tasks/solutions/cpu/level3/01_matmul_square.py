import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <vector>

// C = A @ B for row-major A (M x K), B (K x N); i-k-j loop order, double row accumulator.
torch::Tensor matmul_forward(torch::Tensor A, torch::Tensor B) {
    TORCH_CHECK(A.dim() == 2 && B.dim() == 2, "A and B must be 2-D");
    TORCH_CHECK(A.size(1) == B.size(0), "inner dimensions must match");
    A = A.contiguous();
    B = B.contiguous();
    const int64_t M = A.size(0), K = A.size(1), N = B.size(1);
    auto C = torch::empty({M, N}, A.options());
    const float* a = A.data_ptr<float>();
    const float* b = B.data_ptr<float>();
    float* c = C.data_ptr<float>();
    std::vector<double> acc(N);
    for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) acc[j] = 0.0;
        for (int64_t k = 0; k < K; ++k) {
            const double aik = a[i * K + k];
            const float* brow = b + k * N;
            for (int64_t j = 0; j < N; ++j) acc[j] += aik * brow[j];
        }
        for (int64_t j = 0; j < N; ++j) c[i * N + j] = static_cast<float>(acc[j]);
    }
    return C;
}
"""

matmul_ext = load_inline(
    name="kiln_cpu_l3_matmul_square",
    cpp_sources=cpp_source,
    functions=["matmul_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return matmul_ext.matmul_forward(A, B)
