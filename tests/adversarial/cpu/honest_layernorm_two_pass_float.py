# kiln-adversarial: task=level2/05_layernorm expect=pass
# An honest two-pass layernorm with float accumulators (sequential sums): within tolerance at every offset the family draws. Broken by: offsets of 2^11 and more (families.offset_range), where its float sums drift past the bound.
# kiln-adversarial-include: _spec_extension.py


class ModelNew(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(hidden, eps=1e-5)  # the reference's parameter names: its weights are copied in

    def forward(self, x):
        return spec.layernorm_rows(x, self.ln.weight, self.ln.bias, self.ln.eps, True)
