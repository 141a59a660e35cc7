import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
// relu(conv2d(x, W) + conv_bias) + extra_bias[oc]; stride 1, no padding.
torch::Tensor conv_relu_bias_forward(torch::Tensor x, torch::Tensor weight, torch::Tensor conv_bias,
                                     torch::Tensor extra_bias) {
    TORCH_CHECK(x.dim() == 4 && weight.dim() == 4, "x and weight must be 4-D");
    TORCH_CHECK(x.size(1) == weight.size(1), "channel mismatch");
    TORCH_CHECK(conv_bias.numel() == weight.size(0) && extra_bias.numel() == weight.size(0), "bias size mismatch");
    x = x.contiguous();
    weight = weight.contiguous();
    conv_bias = conv_bias.contiguous();
    extra_bias = extra_bias.contiguous();
    const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    const int64_t OC = weight.size(0), KH = weight.size(2), KW = weight.size(3);
    const int64_t OH = H - KH + 1, OW = W - KW + 1;
    TORCH_CHECK(OH > 0 && OW > 0, "input too small for the kernel");
    auto y = torch::empty({N, OC, OH, OW}, x.options());
    const float* px = x.data_ptr<float>();
    const float* pw = weight.data_ptr<float>();
    const float* pcb = conv_bias.data_ptr<float>();
    const float* peb = extra_bias.data_ptr<float>();
    float* py = y.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t oc = 0; oc < OC; ++oc) {
            for (int64_t oh = 0; oh < OH; ++oh) {
                for (int64_t ow = 0; ow < OW; ++ow) {
                    double acc = pcb[oc];
                    for (int64_t c = 0; c < C; ++c) {
                        const float* xc = px + ((n * C + c) * H + oh) * W + ow;
                        const float* wc = pw + (oc * C + c) * KH * KW;
                        for (int64_t kh = 0; kh < KH; ++kh)
                            for (int64_t kw = 0; kw < KW; ++kw)
                                acc += static_cast<double>(xc[kh * W + kw]) * wc[kh * KW + kw];
                    }
                    const float r = acc > 0.0 ? static_cast<float>(acc) : 0.0f;
                    py[((n * OC + oc) * OH + oh) * OW + ow] = r + peb[oc];
                }
            }
        }
    }
    return y;
}
"""

crb_ext = load_inline(
    name="kiln_cpu_l4_conv_relu_bias",
    cpp_sources=cpp_source,
    functions=["conv_relu_bias_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(0.1 * torch.randn(out_channels, 1, 1))

    def forward(self, x):
        return crb_ext.conv_relu_bias_forward(x, self.conv.weight, self.conv.bias, self.bias)
