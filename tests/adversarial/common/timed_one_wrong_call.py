# kiln-adversarial: task=level1/01_relu expect=cheating
# Right on every correctness trial, then skips the work on one call in five (returns zeros): a timed stage that checked one call of each trip missed each such call K - 1 times in K.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 16 and self.calls % 5 == 0:
            return torch.zeros_like(x)
        return adv.relu_out(x)
