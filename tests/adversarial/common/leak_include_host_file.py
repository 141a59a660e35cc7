# kiln-adversarial: task=level1/01_relu expect=compile
# Includes /etc/passwd so that the compiler quotes it in the feedback.
import torch
import torch.nn as nn


from torch.utils.cpp_extension import load_inline

ext = load_inline(name="kiln_adversarial_leak", cpp_sources='#include "/etc/passwd"\ntorch::Tensor f(torch::Tensor x) { return x; }',
                  functions=["f"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.f(x)
