# kiln-adversarial: task=level1/01_relu expect=pass
# A correct, legal kernel (control case).
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.relu_out(x)
