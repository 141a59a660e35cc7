# kiln-adversarial: task=level1/01_relu expect=cheating
# Computes once and returns the same tensor on every later call.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.result = None

    def forward(self, x):
        if self.result is None:
            self.result = adv.relu_out(x)
        return self.result
