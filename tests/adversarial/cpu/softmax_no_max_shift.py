# kiln-adversarial: task=level1/softmax_unit expect=correctness
# A softmax without the max shift: exp overflows past 88, which standard-normal rows never reach, even 16 times larger; an offset or a larger scale does. Reopened by: dropping offset, large and row_scales from families.ALL.
# kiln-adversarial-include: _spec_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return spec.softmax_rows(x, False)
