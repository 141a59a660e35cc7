import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <cmath>
#include <vector>

namespace {

// out[r, :] = LayerNorm(in[r, :]) * w + b over rows of width D.
void layernorm_rows(const float* in, const float* w, const float* b, float* out, int64_t rows, int64_t D, double eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = in + r * D;
        double mean = 0.0;
        for (int64_t j = 0; j < D; ++j) mean += x[j];
        mean /= D;
        double var = 0.0;
        for (int64_t j = 0; j < D; ++j) { const double d = x[j] - mean; var += d * d; }
        var /= D;
        const double rstd = 1.0 / std::sqrt(var + eps);
        for (int64_t j = 0; j < D; ++j) out[r * D + j] = static_cast<float>((x[j] - mean) * rstd) * w[j] + b[j];
    }
}

// out[r, o] = in[r, :] . W[o, :] + bias[o]  (nn.Linear layout: W is OUT x IN).
void linear_rows(const float* in, const float* W, const float* bias, float* out, int64_t rows, int64_t IN, int64_t OUT) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = in + r * IN;
        for (int64_t o = 0; o < OUT; ++o) {
            const float* w = W + o * IN;
            double acc = bias[o];
            for (int64_t k = 0; k < IN; ++k) acc += static_cast<double>(x[k]) * w[k];
            out[r * OUT + o] = static_cast<float>(acc);
        }
    }
}

}  // namespace

// Pre-norm block: x1 = x + proj(causal_mha(ln1(x))); y = x1 + fc2(gelu(fc1(ln2(x1)))).
torch::Tensor block_forward(torch::Tensor x, int64_t n_heads,
                            torch::Tensor ln1_w, torch::Tensor ln1_b, double ln1_eps,
                            torch::Tensor qkv_w, torch::Tensor qkv_b,
                            torch::Tensor proj_w, torch::Tensor proj_b,
                            torch::Tensor ln2_w, torch::Tensor ln2_b, double ln2_eps,
                            torch::Tensor fc1_w, torch::Tensor fc1_b,
                            torch::Tensor fc2_w, torch::Tensor fc2_b) {
    TORCH_CHECK(x.dim() == 3, "x must be (batch, seq, d_model)");
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    TORCH_CHECK(n_heads > 0 && C % n_heads == 0, "d_model must be divisible by n_heads");
    const int64_t H = n_heads, Dh = C / H, F = fc1_w.size(0);
    TORCH_CHECK(qkv_w.size(0) == 3 * C && qkv_w.size(1) == C, "qkv weight shape");
    TORCH_CHECK(proj_w.size(0) == C && proj_w.size(1) == C, "proj weight shape");
    TORCH_CHECK(fc1_w.size(1) == C && fc2_w.size(0) == C && fc2_w.size(1) == F, "mlp weight shapes");
    x = x.contiguous();
    ln1_w = ln1_w.contiguous(); ln1_b = ln1_b.contiguous();
    qkv_w = qkv_w.contiguous(); qkv_b = qkv_b.contiguous();
    proj_w = proj_w.contiguous(); proj_b = proj_b.contiguous();
    ln2_w = ln2_w.contiguous(); ln2_b = ln2_b.contiguous();
    fc1_w = fc1_w.contiguous(); fc1_b = fc1_b.contiguous();
    fc2_w = fc2_w.contiguous(); fc2_b = fc2_b.contiguous();
    auto out = torch::empty_like(x);
    const int64_t rows = B * T;
    if (rows == 0) return out;
    const float* px = x.data_ptr<float>();
    float* py = out.data_ptr<float>();

    std::vector<float> h(rows * C), qkv(rows * 3 * C), att(rows * C), x1(rows * C), f(rows * F);
    layernorm_rows(px, ln1_w.data_ptr<float>(), ln1_b.data_ptr<float>(), h.data(), rows, C, ln1_eps);
    linear_rows(h.data(), qkv_w.data_ptr<float>(), qkv_b.data_ptr<float>(), qkv.data(), rows, C, 3 * C);

    // Causal multi-head attention. Row t of qkv holds [q | k | v], head hh at columns hh*Dh.
    const double scale = 1.0 / std::sqrt(static_cast<double>(Dh));
    std::vector<double> p(T), acc(Dh);
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t hh = 0; hh < H; ++hh) {
            for (int64_t i = 0; i < T; ++i) {
                const float* q = qkv.data() + (b * T + i) * 3 * C + hh * Dh;
                double m = -INFINITY;
                for (int64_t j = 0; j <= i; ++j) {
                    const float* k = qkv.data() + (b * T + j) * 3 * C + C + hh * Dh;
                    double s = 0.0;
                    for (int64_t d = 0; d < Dh; ++d) s += static_cast<double>(q[d]) * k[d];
                    p[j] = s * scale;
                    if (p[j] > m) m = p[j];
                }
                double sum = 0.0;
                for (int64_t j = 0; j <= i; ++j) { p[j] = std::exp(p[j] - m); sum += p[j]; }
                for (int64_t d = 0; d < Dh; ++d) acc[d] = 0.0;
                for (int64_t j = 0; j <= i; ++j) {
                    const float* v = qkv.data() + (b * T + j) * 3 * C + 2 * C + hh * Dh;
                    const double w = p[j] / sum;
                    for (int64_t d = 0; d < Dh; ++d) acc[d] += w * v[d];
                }
                float* o = att.data() + (b * T + i) * C + hh * Dh;
                for (int64_t d = 0; d < Dh; ++d) o[d] = static_cast<float>(acc[d]);
            }
        }
    }

    linear_rows(att.data(), proj_w.data_ptr<float>(), proj_b.data_ptr<float>(), x1.data(), rows, C, C);
    for (int64_t i = 0; i < rows * C; ++i) x1[i] += px[i];

    layernorm_rows(x1.data(), ln2_w.data_ptr<float>(), ln2_b.data_ptr<float>(), h.data(), rows, C, ln2_eps);
    linear_rows(h.data(), fc1_w.data_ptr<float>(), fc1_b.data_ptr<float>(), f.data(), rows, C, F);
    for (int64_t i = 0; i < rows * F; ++i) {
        const double v = f[i];
        f[i] = static_cast<float>(0.5 * v * (1.0 + std::erf(v * 0.7071067811865476)));
    }
    linear_rows(f.data(), fc2_w.data_ptr<float>(), fc2_b.data_ptr<float>(), py, rows, F, C);
    for (int64_t i = 0; i < rows * C; ++i) py[i] += x1[i];
    return out;
}
"""

block_ext = load_inline(
    name="kiln_cpu_l4_transformer_block",
    cpp_sources=cpp_source,
    functions=["block_forward"],
    verbose=False,
    extra_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, d_model, n_heads, mlp_ratio):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        # Same names, shapes and construction order as the reference, so seeding gives equal params.
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.add_(0.1 * torch.randn(d_model))
                ln.bias.add_(0.1 * torch.randn(d_model))

    def forward(self, x):
        return block_ext.block_forward(
            x, self.n_heads,
            self.ln1.weight, self.ln1.bias, self.ln1.eps,
            self.qkv.weight, self.qkv.bias,
            self.proj.weight, self.proj.bias,
            self.ln2.weight, self.ln2.bias, self.ln2.eps,
            self.fc1.weight, self.fc1.bias,
            self.fc2.weight, self.fc2.bias,
        )
