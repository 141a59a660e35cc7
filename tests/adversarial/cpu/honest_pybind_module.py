# kiln-adversarial: task=level1/01_relu expect=pass
# Honest: PyTorch's extension tutorial layout, the bindings written by hand in PYBIND11_MODULE (no `functions=` list for load_inline to generate them from).
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
#include <torch/extension.h>

torch::Tensor relu_forward(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) d[i] = s[i] > 0.0f ? s[i] : 0.0f;
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &relu_forward, "ReLU forward");
}
"""

ext = load_inline(name="kiln_adv_pybind", cpp_sources=source, verbose=False, extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.forward(x)
