# kiln-adversarial: task=level1/01_relu expect=correctness
# Specialised to the default shape: other valid shapes come out wrong.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.relu_fixed(x)
