# kiln-adversarial: task=level1/cumprod expect=correctness
# A cumprod that writes zeros after 64 elements of each row: standard-normal products underflow there anyway; products near 1 do not. Reopened by: dropping near_one from families.ALL.
# kiln-adversarial-include: _spec_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return spec.cumprod_rows(x, 64)
