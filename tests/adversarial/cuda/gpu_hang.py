# kiln-adversarial: task=level1/01_relu expect=timeout
# A kernel that never finishes.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.spin_forever(x)
