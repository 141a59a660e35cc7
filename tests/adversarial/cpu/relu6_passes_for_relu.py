# kiln-adversarial: task=level1/01_relu expect=correctness
# A kernel that saturates at 6 (ReLU6) for a ReLU task: standard-normal inputs never reach 6, so only inputs of a larger magnitude (the large, offset and row-scale input families) tell it from the real thing.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
torch::Tensor relu6(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) d[i] = s[i] < 0.0f ? 0.0f : (s[i] > 6.0f ? 6.0f : s[i]);
    return y;
}
"""

ext = load_inline(name="kiln_adv_relu6", cpp_sources=source, functions=["relu6"], extra_cflags=["-O2"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu6(x)
