# kiln-adversarial: task=level1/01_relu expect=cheating
# Right for the first twelve calls (the correctness trials: plain, one per input family, sensitivity, canary), a no-op afterwards (the timed runs).
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= 12:
            return adv.relu_out(x)
        return torch.empty_like(x)
