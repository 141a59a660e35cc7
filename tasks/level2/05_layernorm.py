"""LayerNorm over the last dimension of a (batch, seq, hidden) tensor with learned weight and bias
(nn.LayerNorm, eps=1e-5; the affine parameters are perturbed away from 1/0 at construction)."""
import torch
import torch.nn as nn

batch_size = 32
seq_len = 512
hidden = 1024

KILN_CPU_SHAPES = {"batch_size": 4, "seq_len": 32, "hidden": 256}
KILN_ALT_SHAPES = [{"batch_size": 3, "seq_len": 5, "hidden": 77}, {"batch_size": 1, "seq_len": 2, "hidden": 1500}]


class Model(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(hidden, eps=1e-5)
        with torch.no_grad():
            self.ln.weight.add_(0.1 * torch.randn(hidden))
            self.ln.bias.add_(0.1 * torch.randn(hidden))

    def forward(self, x):
        return self.ln(x)


def get_inputs():
    return [torch.randn(batch_size, seq_len, hidden) * 2.0 + 0.5]


def get_init_inputs():
    return [hidden]
