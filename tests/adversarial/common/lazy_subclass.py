# kiln-adversarial: task=level1/01_relu expect=cheating
# Returns a tensor subclass (a lazy result) created without a class statement.
# kiln-adversarial-include: _relu_extension.py


Lazy = type("Lazy", (torch.Tensor,), {})


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.Tensor._make_subclass(Lazy, adv.relu_out(x))
