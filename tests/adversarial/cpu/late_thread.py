# kiln-adversarial: task=level1/01_relu expect=cheating
# Returns at once while a native thread writes the output later (escapes the timer).
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.relu_late(x)
