# kiln-adversarial: task=level3/04_linear expect=pass
# Honest precomputation from the parameters: once the weights are loaded (a load_state_dict post-hook, before any input), the weight is transposed and scaled by ATen (compute on a parameter-sized tensor, within the budget), and forward's own kernel reads the prepared copy.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
// y = x @ Wt + b with Wt (in, out) prepared from the weight.
torch::Tensor linear_t(torch::Tensor x, torch::Tensor wt, torch::Tensor bias) {
    x = x.contiguous();
    const int64_t B = x.size(0), IN = x.size(1), OUT = wt.size(1);
    auto y = torch::empty({B, OUT}, x.options());
    const float* px = x.data_ptr<float>();
    const float* pw = wt.data_ptr<float>();
    const float* pb = bias.data_ptr<float>();
    float* py = y.data_ptr<float>();
    for (int64_t i = 0; i < B; ++i) {
        for (int64_t o = 0; o < OUT; ++o) py[i * OUT + o] = pb[o];
        for (int64_t k = 0; k < IN; ++k) {
            const float xv = px[i * IN + k];
            for (int64_t o = 0; o < OUT; ++o) py[i * OUT + o] += xv * pw[k * OUT + o];
        }
    }
    return y;
}
"""

ext = load_inline(name="kiln_adv_linear_t", cpp_sources=source, functions=["linear_t"], verbose=False, extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.register_load_state_dict_post_hook(lambda module, keys: module.prepare())
        self.prepare()

    def prepare(self):
        with torch.no_grad():
            self.wt = (self.fc.weight * 1.0).t().contiguous()

    def forward(self, x):
        return ext.linear_t(x, self.wt, self.fc.bias)
