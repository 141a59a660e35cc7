# kiln-adversarial: task=level1/01_relu expect=correctness
# An output full of NaN (a bug, or memory never written that holds NaN bit patterns): wrong, and nothing more. Its two looks (at return, and once the device is idle) must compare bit for bit: NaN != NaN would call it work still running after forward returned.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def forward(self, x):
        out = adv.relu_out(x)
        return out.fill_(float("nan"))
