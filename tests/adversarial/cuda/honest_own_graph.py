# kiln-adversarial: task=level1/01_relu expect=pass
# Honest: a CUDA graph of its own kernel, captured once per input shape and replayed in forward (its inputs copied into the graph's static buffer, the output cloned out). Graphs were refused whoever's kernels they held.
# kiln-adversarial-include: _relu_extension.py


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.graphs = {}

    def forward(self, x):
        key = tuple(x.shape)
        if key not in self.graphs:
            static_in = torch.empty_like(x)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                adv.relu_out(static_in)  # a first launch outside the capture (module loaded)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = adv.relu_out(static_in)
            self.graphs[key] = (graph, static_in, static_out)
        graph, static_in, static_out = self.graphs[key]
        static_in.copy_(x)
        graph.replay()
        return static_out.clone()
