# kiln-adversarial: task=level1/transpose expect=pass
# Honest: the kernel writes the transpose into rows padded to a multiple of 16 and returns the unpadded columns, a strided view of its own buffer (not dense). Timed as materialised, it passes.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
torch::Tensor transpose_padded(torch::Tensor x) {
    x = x.contiguous();
    const int64_t R = x.size(0), C = x.size(1), P = (R + 15) / 16 * 16;
    auto buf = torch::empty({C, P}, x.options());
    const float* s = x.data_ptr<float>();
    float* d = buf.data_ptr<float>();
    for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < C; ++j) d[j * P + i] = s[i * C + j];
    return buf.narrow(1, 0, R);
}
"""

ext = load_inline(name="kiln_adv_strided", cpp_sources=source, functions=["transpose_padded"], verbose=False, extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.transpose_padded(x)
