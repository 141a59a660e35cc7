# kiln-adversarial: task=level1/01_relu expect=runtime
# A CUDA illegal memory access: costs one sandbox child, not the verifier.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.illegal_access(x)
