# kiln-adversarial: task=level1/transpose expect=cheating
# No kernel at all: returns x.t(), a view of the input; the snapshot copy materialised it, and the null trip's copy of the same view cancelled that in the trusted clock (score 2.0 before).
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x.t()
