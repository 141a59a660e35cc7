# kiln-adversarial: task=level1/softmax_unit expect=pass
# The same softmax with the max shift (float sums): right on every input family.
# kiln-adversarial-include: _spec_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return spec.softmax_rows(x, True)
