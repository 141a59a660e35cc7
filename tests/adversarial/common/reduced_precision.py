# kiln-adversarial: task=level1/01_relu expect=correctness
# Computes with bfloat16 precision: error beyond the fp32 tolerance.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        return adv.relu_bf16(x)
