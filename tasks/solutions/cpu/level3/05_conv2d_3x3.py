import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
// Direct 2-D convolution (NCHW, OIHW weights) with bias, zero padding and stride.
torch::Tensor conv2d_forward(torch::Tensor x, torch::Tensor weight, torch::Tensor bias,
                             int64_t stride, int64_t padding) {
    TORCH_CHECK(x.dim() == 4 && weight.dim() == 4, "x and weight must be 4-D");
    TORCH_CHECK(x.size(1) == weight.size(1), "channel mismatch");
    x = x.contiguous();
    weight = weight.contiguous();
    bias = bias.contiguous();
    const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    const int64_t OC = weight.size(0), KH = weight.size(2), KW = weight.size(3);
    const int64_t OH = (H + 2 * padding - KH) / stride + 1;
    const int64_t OW = (W + 2 * padding - KW) / stride + 1;
    TORCH_CHECK(OH > 0 && OW > 0, "input too small for the kernel");
    auto y = torch::empty({N, OC, OH, OW}, x.options());
    const float* px = x.data_ptr<float>();
    const float* pw = weight.data_ptr<float>();
    const float* pb = bias.data_ptr<float>();
    float* py = y.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t oc = 0; oc < OC; ++oc) {
            const float* wo = pw + oc * C * KH * KW;
            for (int64_t oh = 0; oh < OH; ++oh) {
                for (int64_t ow = 0; ow < OW; ++ow) {
                    double acc = pb[oc];
                    for (int64_t c = 0; c < C; ++c) {
                        const float* xc = px + (n * C + c) * H * W;
                        const float* wc = wo + c * KH * KW;
                        for (int64_t kh = 0; kh < KH; ++kh) {
                            const int64_t ih = oh * stride - padding + kh;
                            if (ih < 0 || ih >= H) continue;
                            for (int64_t kw = 0; kw < KW; ++kw) {
                                const int64_t iw = ow * stride - padding + kw;
                                if (iw < 0 || iw >= W) continue;
                                acc += static_cast<double>(xc[ih * W + iw]) * wc[kh * KW + kw];
                            }
                        }
                    }
                    py[((n * OC + oc) * OH + oh) * OW + ow] = static_cast<float>(acc);
                }
            }
        }
    }
    return y;
}
"""

conv_ext = load_inline(
    name="kiln_cpu_l3_conv2d_3x3",
    cpp_sources=cpp_source,
    functions=["conv2d_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=True)

    def forward(self, x):
        return conv_ext.conv2d_forward(x, self.conv.weight, self.conv.bias, 1, 1)
