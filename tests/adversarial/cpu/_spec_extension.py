import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# One extension shared by the CPU cases about correctness as a specification (input families, the
# sensitivity trial): each wrong kernel beside its honest twin, so every case builds the same library.
spec_source = r"""
#include <cmath>
#include <cstdint>

// Softmax over the last dimension, accumulating in float. `shift`: subtract the row's max first (the
// stable way); without it exp overflows once a value passes 88.
torch::Tensor softmax_rows(torch::Tensor x, bool shift) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const float* in = s + r * cols;
        float* o = d + r * cols;
        float m = 0.0f;
        if (shift) {
            m = in[0];
            for (int64_t c = 1; c < cols; ++c) m = in[c] > m ? in[c] : m;
        }
        float sum = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
            o[c] = std::exp(in[c] - m);
            sum += o[c];
        }
        for (int64_t c = 0; c < cols; ++c) o[c] /= sum;
    }
    return y;
}

// LayerNorm over the last dimension with float accumulators. `two_pass`: the mean, then the squared
// deviations from it; else one pass, E[x^2] - E[x]^2, which cancels catastrophically once |mean| >> std.
torch::Tensor layernorm_rows(torch::Tensor x, torch::Tensor w, torch::Tensor b, double eps, bool two_pass) {
    x = x.contiguous();
    w = w.contiguous();
    b = b.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
    const float* s = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = b.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const float* in = s + r * n;
        float* o = d + r * n;
        float sum = 0.0f, squares = 0.0f;
        for (int64_t c = 0; c < n; ++c) {
            sum += in[c];
            squares += in[c] * in[c];
        }
        const float mean = sum / n;
        float var = squares / n - mean * mean;
        if (two_pass) {
            var = 0.0f;
            for (int64_t c = 0; c < n; ++c) var += (in[c] - mean) * (in[c] - mean);
            var /= n;
        }
        const float rstd = 1.0f / std::sqrt((var > 0.0f ? var : 0.0f) + static_cast<float>(eps));
        for (int64_t c = 0; c < n; ++c) o[c] = (in[c] - mean) * rstd * wp[c] + bp[c];
    }
    return y;
}

// Cumulative product over the last dimension. `keep` > 0: only the first `keep` elements of each row
// are computed, the rest written as zeros (randn's products have underflowed there anyway).
torch::Tensor cumprod_rows(torch::Tensor x, int64_t keep) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        float p = 1.0f;
        for (int64_t c = 0; c < n; ++c) {
            p = (keep > 0 && c >= keep) ? 0.0f : p * s[r * n + c];
            d[r * n + c] = p;
        }
    }
    return y;
}

// The variance of each row over the last dimension, two passes in double: exact to float32.
torch::Tensor variance_rows(torch::Tensor x) {
    x = x.contiguous();
    const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
    auto y = torch::empty({rows}, x.options());
    const float* s = x.data_ptr<float>();
    float* d = y.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        double mean = 0.0, var = 0.0;
        for (int64_t c = 0; c < n; ++c) mean += s[r * n + c];
        mean /= n;
        for (int64_t c = 0; c < n; ++c) var += (s[r * n + c] - mean) * (s[r * n + c] - mean);
        d[r] = static_cast<float>(var / n);
    }
    return y;
}

// Whether 64 elements sampled across x look like a standard-normal draw (no zeros, mean near 0,
// mean square near 1, nothing beyond 8): what every input family changes, and a small perturbation
// of such a draw does not.
static bool looks_plain(const float* v, int64_t n) {
    double sum = 0.0, squares = 0.0;
    for (int k = 0; k < 64; ++k) {
        const float e = v[(n / 64) * k];
        if (e == 0.0f || std::fabs(e) > 8.0f) return false;
        sum += e;
        squares += static_cast<double>(e) * e;
    }
    return std::fabs(sum / 64) < 0.5 && squares / 64 > 0.5 && squares / 64 < 2.0;
}

// Mean squared error. `shortcut` 1: the constant E[(p - t)^2] = 2 of two standard-normal inputs
// unless a sampled |p| exceeds 8 (the x16 trial); 2: the constant unless sampled inputs stop looking
// like plain draws (every family); 0: computed.
torch::Tensor mse(torch::Tensor p, torch::Tensor t, int64_t shortcut) {
    p = p.contiguous();
    t = t.contiguous();
    auto y = torch::empty({}, p.options());
    const float* a = p.data_ptr<float>();
    const float* b = t.data_ptr<float>();
    const int64_t n = p.numel();
    bool constant = false;
    if (shortcut == 1) {
        constant = true;
        for (int k = 0; k < 64; ++k) constant = constant && std::fabs(a[(n / 64) * k]) <= 8.0f;
    } else if (shortcut == 2) {
        constant = looks_plain(a, n) && looks_plain(b, n);
    }
    if (constant) {
        *y.data_ptr<float>() = 2.0f;
        return y;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(a[i] - b[i]) * (a[i] - b[i]);
    *y.data_ptr<float>() = static_cast<float>(sum / n);
    return y;
}
"""

spec = load_inline(
    name="kiln_adv_spec",
    cpp_sources=spec_source,
    functions=["softmax_rows", "layernorm_rows", "cumprod_rows", "variance_rows", "mse"],
    extra_cflags=["-O2"],
    verbose=False,
)
