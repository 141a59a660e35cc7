# kiln-adversarial: task=level1/cumprod expect=pass
# An honest sequential cumprod in float: right on every input family the reference computes finitely.
# kiln-adversarial-include: _spec_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return spec.cumprod_rows(x, 0)
