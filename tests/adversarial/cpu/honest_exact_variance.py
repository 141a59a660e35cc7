# kiln-adversarial: task=level1/variance_one_pass expect=pass
# An exact (double) row variance against a reference that computes E[x^2] - E[x]^2 in float32: at a large offset the reference is the one that is off, and the float64 allowance lets the exact kernel pass. Broken by: Family("offset", ..., float64=False) (no allowance).
# kiln-adversarial-include: _spec_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return spec.variance_rows(x)
