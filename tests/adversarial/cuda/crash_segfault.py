# kiln-adversarial: task=level1/01_relu expect=runtime
# Segfaults in host code of the extension.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.crash(x)
