# kiln-adversarial: task=level1/01_relu expect=pass
# A correct kernel whose module, __init__ and forward import standard-library modules nothing imported before (a module first loaded after the sandbox is armed must load, from its source).
# kiln-adversarial-include: _relu_extension.py
import colorsys


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        import fractions

        self.half = fractions.Fraction(1, 2) + colorsys.ONE_THIRD * 0

    def forward(self, x):
        import sndhdr  # noqa: F401 - first imported here, during a call

        return adv.relu_out(x)
