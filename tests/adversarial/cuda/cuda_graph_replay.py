# kiln-adversarial: task=level1/01_relu expect=cheating
# Records torch.relu into a CUDA graph and replays it (no ATen call at replay).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.graph = None

    def forward(self, x):
        if self.graph is None or self.static_in.shape != x.shape:
            self.static_in = x.clone()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = torch.relu(self.static_in)
        self.static_in.copy_(x)
        self.graph.replay()
        return self.static_out.clone()
