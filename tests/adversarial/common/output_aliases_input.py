# kiln-adversarial: task=level1/01_relu expect=cheating
# Returns its (overwritten) input as the output.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.relu_inplace(x)
