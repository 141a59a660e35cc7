# kiln-adversarial: task=level2/05_layernorm expect=correctness
# A one-pass variance, E[x^2] - E[x]^2 in float: exact enough for the task's draw, catastrophic cancellation at a large shared offset. Reopened by: dropping offset from families.ALL.
# kiln-adversarial-include: _spec_extension.py


class ModelNew(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(hidden, eps=1e-5)  # the reference's parameter names: its weights are copied in

    def forward(self, x):
        return spec.layernorm_rows(x, self.ln.weight, self.ln.bias, self.ln.eps, False)
