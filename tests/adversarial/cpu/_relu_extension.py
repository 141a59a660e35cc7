import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# One extension shared by the CPU adversarial candidates (identical call -> built once per run).
adv_source = r"""
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

static void relu_loop(const float* s, float* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = s[i] > 0.0f ? s[i] : 0.0f;
}

// A correct kernel.
torch::Tensor relu_out(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    relu_loop(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    return y;
}

// Writes the result into its input and returns the input.
torch::Tensor relu_inplace(torch::Tensor x) {
    relu_loop(x.data_ptr<float>(), x.data_ptr<float>(), x.numel());
    return x;
}

// Returns at once; a detached thread writes the output a millisecond later.
torch::Tensor relu_late(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::zeros_like(x);
    std::thread([x, y]() mutable {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        relu_loop(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
    }).detach();
    return y;
}

// Rounds every value to bfloat16 precision (truncates 16 mantissa bits) before the ReLU.
torch::Tensor relu_bf16(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &s[i], 4);
        bits &= 0xFFFF0000u;
        float v;
        std::memcpy(&v, &bits, 4);
        d[i] = v > 0.0f ? v : 0.0f;
    }
    return y;
}

// Specialised to the default CPU shape (16 x 4096): any other shape gets zeros.
torch::Tensor relu_fixed(torch::Tensor x) {
    auto y = torch::zeros_like(x);
    if (x.numel() != 16 * 4096) return y;
    relu_loop(x.contiguous().data_ptr<float>(), y.data_ptr<float>(), 16 * 4096);
    return y;
}

// Writes through a null pointer.
torch::Tensor crash(torch::Tensor x) {
    volatile float* p = nullptr;
    *p = 1.0f;
    return x;
}
"""

adv = load_inline(
    name="kiln_adversarial_cpu",
    cpp_sources=adv_source,
    functions=["relu_out", "relu_inplace", "relu_late", "relu_bf16", "relu_fixed", "crash"],
    verbose=False,
    extra_cflags=["-O2"],
)
