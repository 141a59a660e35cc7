# kiln-adversarial: task=level1/01_relu expect=cheating
# Computes once and returns a fresh copy of that first result on later calls.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.result = None

    def forward(self, x):
        if self.result is None or self.result.shape != x.shape:
            self.result = adv.relu_out(x)
        return self.result.clone()
