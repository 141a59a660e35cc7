# kiln-adversarial: task=level1/01_relu expect=pass
# Honest: computes on a stream of its own that waits for the caller's, tells the caching allocator so (Tensor.record_stream, refused before as an ATen op), and makes the caller's stream wait for it.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.side = None

    def forward(self, x):
        if self.side is None:
            self.side = torch.cuda.Stream()
        caller = torch.cuda.current_stream()
        self.side.wait_stream(caller)
        with torch.cuda.stream(self.side):
            y = adv.relu_out(x)
        x.record_stream(self.side)
        y.record_stream(caller)
        caller.wait_stream(self.side)
        return y
