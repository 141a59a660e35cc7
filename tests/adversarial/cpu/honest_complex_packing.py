# kiln-adversarial: task=level1/complex_pack expect=pass
# Honest and exact: packs each pair of floats into one complex64 (the two floats are its layout). An output dtype the verifier could not carry made it a -1 before.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
torch::Tensor pack(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty({x.size(0), x.size(1) / 2}, x.options().dtype(torch::kComplexFloat));
    const float* s = x.data_ptr<float>();
    float* d = reinterpret_cast<float*>(y.data_ptr<c10::complex<float>>());
    for (int64_t i = 0, n = x.numel(); i < n; ++i) d[i] = s[i];
    return y;
}
"""

ext = load_inline(name="kiln_adv_complex_pack", cpp_sources=source, functions=["pack"], verbose=False, extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.pack(x)
