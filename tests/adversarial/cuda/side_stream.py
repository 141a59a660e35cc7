# kiln-adversarial: task=level1/01_relu expect=cheating
# Launches on a private stream and returns before the work is done (escapes the timer).
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.relu_side_stream(x)
